"""`torchtop run -- CMD...`: run a training command with the agent injected, no code change.

The child gets TORCHTOP=1 and torchtop's bootstrap `sitecustomize` first on PYTHONPATH (it arms
the agent's autostart, then runs whatever sitecustomize the environment already had), so any
Python process of the job that imports torch starts an agent: `python train.py`, `python -m
pkg.train`, every rank of `torchrun` (not the launcher). With the TUI the job's output goes to a
log file, shown in the TUI's Log tab; with --no-tui it stays on this terminal. The exit code is
the job's; Ctrl-C reaches the job.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from torchtop.monitor.commands.launch import LaunchError, _show_tail, open_log, wait_for_agents

EXIT_USAGE = 2


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--port",
        type=int,
        default=None,
        help="the agent's request port (rank r of torchrun gets PORT + 2r); default: free ports",
    )
    p.add_argument(
        "--no-tui",
        action="store_true",
        help="only inject the agent: the job's output stays here; prints how to attach",
    )
    p.add_argument("--log-dir", default=None, metavar="DIR", help="where the job's output goes (TUI mode)")
    p.add_argument(
        "command", nargs=argparse.REMAINDER, help="-- then the command, e.g. -- python train.py --lr 3e-4"
    )


def boot_dir() -> Path:
    import torchtop.agent

    return Path(torchtop.agent.__file__).resolve().parent / "_boot"


def child_env(port: int | None, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env["TORCHTOP"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(boot_dir()), env.get("PYTHONPATH", "")) if p)
    if port is not None:
        env["TORCHTOP_PORT"] = str(port)
    return env


def job_name(command: list[str]) -> str:
    """A short name for the log file: the script or module, else the program."""
    for i, word in enumerate(command):
        if word == "-m" and i + 1 < len(command):
            return command[i + 1].replace(".", "_")
        if word.endswith(".py"):
            return Path(word).stem
    return Path(command[0]).name


def _wait_forwarding(child: subprocess.Popen) -> int:
    """Wait for the job. Ctrl-C reaches it through the terminal (same process group); we ignore
    it here so the job's own exit code is what we return."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return child.wait()
    finally:
        signal.signal(signal.SIGINT, previous)


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as shells report it


def run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print(
            "torchtop: give the command to run after --, e.g. torchtop run -- python train.py",
            file=sys.stderr,
        )
        return EXIT_USAGE
    env = child_env(args.port)
    if args.no_tui:
        return _run_headless(command, env)
    from torchtop.monitor.tui.app import (
        run_tui,  # before the job starts: a broken install leaves nothing running
    )

    try:
        log_path, log = open_log(job_name(command), args.log_dir, kind="run")
    except LaunchError as exc:
        print(f"torchtop: {exc}", file=sys.stderr)
        return 1
    try:
        with log:
            child = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env
            )
    except OSError as exc:
        print(f"torchtop: cannot run {command[0]!r}: {exc.strerror or exc}", file=sys.stderr)
        return 127
    print(f"torchtop run: pid {child.pid}; output: {log_path}", flush=True)
    try:
        agents = wait_for_agents(child, settle=2.0)
    except TimeoutError as exc:
        _show_tail(log_path, f"{exc} (does it import torch? is torchtop installed in its Python?)")
        return _exit_code(_wait_forwarding(child))
    except KeyboardInterrupt:
        child.send_signal(signal.SIGINT)
        return _exit_code(_wait_forwarding(child))
    if not agents:
        code = child.wait()
        _show_tail(log_path, f"the job exited (code {code}) before an agent started")
        return _exit_code(code)
    from torchtop.monitor.commands.launch import wait_for_ranks
    from torchtop.monitor.tui.job_app import run_agents_tui

    if run_agents_tui(wait_for_ranks(child, agents), log_path=log_path) is None:
        run_tui(None, agents, log_path=log_path)
    if child.poll() is None:
        print(
            f"torchtop: the job goes on (pid {child.pid}); its output: {log_path}\n"
            f"          attach again with `torchtop attach {agents[0]['pid']}`; Ctrl-C stops the job",
            flush=True,
        )
    return _exit_code(_wait_forwarding(child))


def _run_headless(command: list[str], env: dict[str, Any]) -> int:
    try:
        child = subprocess.Popen(command, env=env)
    except OSError as exc:
        print(f"torchtop: cannot run {command[0]!r}: {exc.strerror or exc}", file=sys.stderr)
        return 127
    print(
        f"torchtop run: pid {child.pid}; attach with `torchtop attach` (or `torchtop ls` for every rank)",
        file=sys.stderr,
        flush=True,
    )
    return _exit_code(_wait_forwarding(child))
