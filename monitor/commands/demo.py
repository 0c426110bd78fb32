"""`torchtop demo`: start a demo training job as a child process and open the TUI on it.

The job is `python -m torchtop.demos.<scenario>`, with its output in a log file; the launcher finds
its agent through the discovery file (the same way `torchtop attach PID` does) and stops the job,
worker processes included, when the TUI closes. The monitor never imports torch: whether CUDA
exists is judged inside the child, which exits with a one-line reason that is shown here.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import pkgutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from torchtop.monitor.commands.launch import (
    LaunchError,
    _die_with_parent,
    _show_tail,
    open_log,
    stop_child,
    wait_for_agents,
    wait_for_ranks,
)

DEMOS_PACKAGE = "torchtop.demos"
DEFAULT_SCENARIO = "balanced"
ENV_LAUNCHED = "TORCHTOP_DEMO_LAUNCHED"  # demos/common.py reads it
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130


# -- scenarios -----------------------------------------------------------------------------------
def scenarios() -> dict[str, str]:
    """Scenario name -> one-line description, read from the demo modules' source (never imported)."""
    spec = importlib.util.find_spec(DEMOS_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return {}
    locations = [loc for loc in spec.submodule_search_locations if os.path.isdir(loc)]
    helpers = _helpers(locations)
    found = {}
    for info in pkgutil.iter_modules(locations):
        if info.ispkg or info.name.startswith("_") or info.name in helpers:
            continue
        found[info.name.replace("_", "-")] = _first_doc_line(info.module_finder, info.name)
    return dict(sorted(found.items()))


def module_name(scenario: str) -> str:
    """`data-bound` (as listed) or `data_bound` (the module) -> the module's name."""
    return scenario.replace("-", "_")


def _helpers(locations: list[str]) -> set[str]:
    """`HELPERS` of demos/__init__.py, read with ast (an editable install never runs that file)."""
    out: set[str] = set()
    for loc in locations:
        try:
            tree = ast.parse(Path(loc, "__init__.py").read_text(encoding="utf-8"))
        except (OSError, SyntaxError):
            continue
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "HELPERS" for t in node.targets):
                try:
                    out.update(ast.literal_eval(node.value))
                except ValueError:
                    pass
    return out


def _first_doc_line(finder: Any, name: str) -> str:
    try:
        spec = finder.find_spec(f"{DEMOS_PACKAGE}.{name}")
        source = Path(spec.origin).read_text(encoding="utf-8")
        doc = ast.get_docstring(ast.parse(source)) or ""
        return doc.strip().splitlines()[0] if doc.strip() else ""
    except Exception:  # broad: a demo that cannot be read has no description
        return ""


def _scenario_help() -> str:
    names = ", ".join(scenarios()) or "none found"
    return f"which demo to run (default {DEFAULT_SCENARIO}; available: {names}; --list describes them)"


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    from torchtop.monitor.commands.args import seconds

    p.add_argument("--scenario", default=DEFAULT_SCENARIO, metavar="NAME", help=_scenario_help())
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="where the demo trains (auto: cuda if the demo's torch sees a GPU)",
    )
    p.add_argument(
        "--no-tui",
        action="store_true",
        help="run the demo without the TUI: print its pid and how to attach, wait for it",
    )
    p.add_argument("--steps", type=int, default=None, help="stop the demo after N steps (default: never)")
    p.add_argument(
        "--seconds", type=seconds, default=None, help="stop the demo after S seconds (default: never)"
    )
    p.add_argument(
        "--port", type=int, default=None, help="the demo agent's request port (default: a free one)"
    )
    p.add_argument(
        "--log-dir",
        default=None,
        metavar="DIR",
        help="where the demo's output goes (default $XDG_STATE_HOME/torchtop/logs or ~/.cache/torchtop/logs)",
    )


# -- the child -----------------------------------------------------------------------------------
def child_command(args: argparse.Namespace) -> list[str]:
    cmd = [sys.executable, "-m", f"{DEMOS_PACKAGE}.{module_name(args.scenario)}", "--device", args.device]
    for flag, value in (("--steps", args.steps), ("--seconds", args.seconds), ("--port", args.port)):
        if value is not None:
            cmd += [flag, str(value)]
    return cmd


def spawn(args: argparse.Namespace, log: Any) -> subprocess.Popen:
    """Start the demo in its own process group (its workers too), output to `log`."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env[ENV_LAUNCHED] = "1"
    cmd = child_command(args)
    log.write(("$ " + " ".join(cmd) + "\n").encode())
    log.flush()
    return subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,  # terminal signals go to the launcher, which stops the job in order
        preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
    )


def _failure_code(code: int | None) -> int:
    return code if code is not None and code > 0 else EXIT_FAILED


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


# -- entry point ---------------------------------------------------------------------------------
def run_demo(args: argparse.Namespace) -> int:
    available = scenarios()
    if args.list:
        width = max((len(n) for n in available), default=0)
        for name, doc in available.items():
            print(f"{name:<{width}}  {doc}")
        return 0
    if args.scenario.replace("_", "-") not in available:
        names = ", ".join(available) or "none"
        print(f"torchtop: unknown demo scenario {args.scenario!r}; available: {names}", file=sys.stderr)
        return 2
    args.scenario = args.scenario.replace("_", "-")
    for flag, value in (("--steps", args.steps), ("--seconds", args.seconds)):
        if value is not None and value <= 0:
            print(f"torchtop: {flag} must be positive", file=sys.stderr)
            return 2
    run_tui = None
    if not args.no_tui:
        from torchtop.monitor.commands.tui_entry import EXIT_NO_TUI, TuiMissing, require_tui

        try:  # before the child starts: a broken install leaves nothing running
            require_tui()
        except TuiMissing as exc:
            print(f"torchtop: {exc}", file=sys.stderr)
            return EXIT_NO_TUI
        from torchtop.monitor.tui.app import run_tui
    try:
        log_path, log = open_log(args.scenario, args.log_dir)
    except LaunchError as exc:
        print(f"torchtop: {exc}", file=sys.stderr)
        return EXIT_FAILED

    previous = {s: signal.signal(s, _raise_interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    child = None
    try:
        with log:
            child = spawn(args, log)
        print(f"torchtop demo: {args.scenario} (pid {child.pid}); log: {log_path}", flush=True)
        try:
            agents = wait_for_agents(child)
        except TimeoutError as exc:
            _show_tail(log_path, str(exc))
            return EXIT_FAILED
        info = agents[0] if agents else None
        if info is None:
            code = child.wait()
            _show_tail(log_path, f"the demo exited (code {code}) before its agent started")
            return _failure_code(code)
        if run_tui is None:
            return _wait_headless(child, log_path)
        from torchtop.monitor.link.targets import from_discovery

        for s, handler in previous.items():  # the TUI owns the terminal; PDEATHSIG covers the child
            signal.signal(s, handler)
        from torchtop.monitor.tui.job_launch import run_agents_tui

        code = None
        if (info.world_size or 1) > 1:  # a job of several ranks: the job view
            code = run_agents_tui(wait_for_ranks(child, agents), mode="demo")
        if code is None:
            code = run_tui(from_discovery(info), None, mode="demo")  # q: quit and stop the demo
        if child.poll() is not None and child.returncode != 0:
            _show_tail(log_path, f"the demo exited with code {child.returncode}")
        return code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    finally:
        if child is not None:
            stop_child(child)
        for s, handler in previous.items():
            signal.signal(s, handler)


def _wait_headless(child: subprocess.Popen, log_path: Path) -> int:
    print(f"  pid:    {child.pid}", flush=True)
    print(f"  attach: torchtop attach {child.pid}", flush=True)
    print(f"  log:    {log_path}", flush=True)
    print("  stop:   Ctrl-C", flush=True)
    code = child.wait()
    if code != 0:
        _show_tail(log_path, f"the demo exited with code {code}")
        return _failure_code(code)
    print(f"torchtop demo: finished; log: {log_path}", flush=True)
    return 0
