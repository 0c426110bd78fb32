"""`torchtop demo` (placeholder until the demo launcher lands)."""

from __future__ import annotations

import argparse


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", default="balanced")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--no-tui", action="store_true")


def run_demo(args: argparse.Namespace) -> int:
    raise NotImplementedError
