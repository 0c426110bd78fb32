"""Command-line values checked where argparse reads them: one line saying what is wrong, never
a traceback (a NaN number of seconds, a port past 65535, an output file nobody can write)."""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import NoReturn

MAX_SECONDS = 10 * 365 * 86400.0  # ten years: any longer is a typo
EXIT_NO_AGENT = 2  # a command's bad input (unknown target, dead agent, closed port)


def fail(message: str, code: int = EXIT_NO_AGENT) -> int:
    """Say what is wrong in one line on stderr; the exit code."""
    print(f"torchtop: {message}", file=sys.stderr)
    return code


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (argparse prints the usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"torchtop: {message} (see `{self.prog} --help`)\n")


def _number(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not {what}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not {what}")
    return value


def seconds(text: str) -> float:
    """A positive, finite number of seconds."""
    value = _number(text, "a number of seconds")
    if not 0 < value <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{text[:40]!r}: give seconds above 0 (at most {MAX_SECONDS:g})")
    return value


def positive(text: str) -> float:
    """A positive, finite number (a speed, milliseconds)."""
    value = _number(text, "a number")
    if not 0 < value <= 1e12:
        raise argparse.ArgumentTypeError(f"{text[:40]!r}: give a number above 0")
    return value


def listen(spec: str) -> tuple[str, int]:
    """[ADDR:]PORT to serve on: (addr, port), the port in 1..65535."""
    addr, _, port = spec.rpartition(":")
    addr = addr.strip("[]") or "127.0.0.1"
    if not (port.isascii() and port.isdigit() and len(port) <= 5 and 0 < int(port) <= 65535):
        raise argparse.ArgumentTypeError(f"{spec[:60]!r}: give [ADDR:]PORT with a port in 1..65535")
    if not addr.isprintable() or len(addr) > 253:
        raise argparse.ArgumentTypeError(f"{spec[:60]!r}: not an address to listen on")
    return addr, int(port)


def output_file(path: str) -> str:
    """A file to write: its directory exists and is writable (checked before the work, not after)."""
    if "\0" in path or not path.strip():
        raise argparse.ArgumentTypeError(f"{path[:60]!r} is not a file name")
    directory = os.path.dirname(os.path.abspath(os.path.expanduser(path))) or "."
    if not os.path.isdir(directory):
        raise argparse.ArgumentTypeError(f"{path[:80]}: no directory {directory[:80]}")
    if not os.access(directory, os.W_OK):
        raise argparse.ArgumentTypeError(f"{path[:80]}: cannot write in {directory[:80]}")
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path[:80]} is a directory")
    return path
