"""`torchtop run -- CMD...`: run a training command with the agent injected, no code change.

The child gets TORCHTOP=1 and torchtop's bootstrap `sitecustomize` first on PYTHONPATH (it arms
the agent's autostart, then runs whatever sitecustomize the environment already had), so any
Python process of the job that imports torch starts an agent: `python train.py`, `python -m
pkg.train`, every rank of `torchrun` (not the launcher). With the TUI the job's output goes to a
log file, shown in the TUI's Log tab; with --no-tui it stays on this terminal. The job runs in
its own process group: SIGTERM, SIGHUP and SIGINT sent to `torchtop run` are passed on to it
(a scheduler's SIGTERM stops the job, not only the launcher), a Ctrl-C at the terminal reaches
it once, and the exit code is the job's (128 + N when a signal N ended it).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchtop.contract.discovery import AgentInfo
from torchtop.monitor.commands.launch import (
    Job,
    LaunchError,
    _show_tail,
    foreground,
    open_log,
    started,
    wait_for_agents,
    wait_for_ranks,
)

if TYPE_CHECKING:
    from torchtop.monitor.tui.app import TorchtopApp
    from torchtop.monitor.tui.bindings import Leaving

EXIT_USAGE = 2
PATIENT_S = 30.0  # waiting this long for the job's first step: said in a line
FIRST_STEP_S = 600.0  # then this much more before giving up on the TUI (the job goes on)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--port",
        type=int,
        default=None,
        help="listen on TCP (CURVE) at this request port (rank r of torchrun gets PORT + 2r); "
        "default: private Unix sockets",
    )
    p.add_argument(
        "--no-tui",
        action="store_true",
        help="only inject the agent: the job's output stays here; prints how to attach",
    )
    p.add_argument("--log-dir", default=None, metavar="DIR", help="where the job's output goes (TUI mode)")
    p.add_argument(
        "--record",
        default=None,
        metavar="PATH",
        help="every rank records the run into PATH/rank<r>, watched or not (torchtop replay PATH)",
    )
    p.add_argument(
        "command", nargs=argparse.REMAINDER, help="-- then the command, e.g. -- python train.py --lr 3e-4"
    )


def boot_dir() -> Path:
    import torchtop.agent

    return Path(torchtop.agent.__file__).resolve().parent / "_boot"


def child_env(
    port: int | None, base: dict[str, str] | None = None, record: str | None = None
) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    if record:
        env["TORCHTOP_RECORD"] = str(Path(record).resolve())  # the job may change directory
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


def _finish(job: Job) -> int:
    """Wait for the job, holding the terminal for it (Ctrl-C reaches it, once); its exit code."""
    with foreground(job):
        return _exit_code(job.wait())


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
    env = child_env(args.port, record=args.record)
    if args.no_tui:
        return _run_headless(command, env)
    from torchtop.monitor.commands.tui_entry import EXIT_NO_TUI, TuiMissing, require_tui

    try:  # before the job starts: a broken install leaves nothing running
        require_tui()
    except TuiMissing as exc:
        print(f"torchtop: {exc}", file=sys.stderr)
        return EXIT_NO_TUI
    from torchtop.monitor.tui.app import TorchtopApp

    try:
        log_path, log = open_log(job_name(command), args.log_dir, kind="run")
    except LaunchError as exc:
        print(f"torchtop: {exc}", file=sys.stderr)
        return 1
    with ExitStack() as stack:
        try:
            with log:
                job = stack.enter_context(
                    started(command, env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
                )
        except OSError as exc:
            print(f"torchtop: cannot run {command[0]!r}: {exc.strerror or exc}", file=sys.stderr)
            return 127
        return _run_with_tui(job, log_path, TorchtopApp)


def _run_with_tui(job: Job, log_path: Path, app_class: type[TorchtopApp]) -> int:
    print(f"torchtop run: pid {job.pid}; output: {log_path}", flush=True)
    try:
        agents = _wait_for_first_step(job)
    except TimeoutError as exc:
        _show_tail(log_path, f"{exc} (does it import torch? is torchtop installed in its Python?)")
        return _finish(job)
    if not agents:
        code = job.wait()
        if job.forwarded is None:
            _show_tail(log_path, f"the job exited (code {code}) before an agent started")
        return _exit_code(code)
    from torchtop.monitor.tui.bindings import Leaving

    stopped: list[bool] = []  # Ctrl-C in the TUI signalled the job

    def stop_job() -> None:  # the TUI holds the terminal in raw mode: Ctrl-C there is a key
        job.signal(signal.SIGINT)
        stopped.append(True)

    if job.forwarded is None:  # not told to stop meanwhile
        app = _app_for(app_class, wait_for_ranks(job.proc, agents), log_path, Leaving("run", stop_job))
        job.on_forward = lambda _signum: _close_when_done(job, app)
        try:
            app.run()
        finally:
            job.on_forward = None
    if stopped:
        print(f"torchtop: Ctrl-C: SIGINT sent to the job (pid {job.pid}); waiting for it to end", flush=True)
    elif job.poll() is None:
        print(
            f"torchtop: the job goes on (pid {job.pid}); its output: {log_path}\n"
            f"          attach again with `torchtop attach {agents[0].pid}`; Ctrl-C stops the job",
            flush=True,
        )
    return _finish(job)


def _wait_for_first_step(job: Job) -> list[AgentInfo]:
    """The job's agents once a process of it runs its model (zero-code agents are listed only
    then: a launcher or a helper that imports torch is not a rank); a line after a while, since
    a job may load data for minutes before its first step."""
    try:
        return wait_for_agents(job.proc, timeout=PATIENT_S, settle=2.0)
    except TimeoutError:
        print(
            f"torchtop run: no process of the job has run a model yet ({PATIENT_S:.0f} s); the TUI "
            f"opens when one does (waiting up to {FIRST_STEP_S / 60:.0f} min more)",
            flush=True,
        )
    return wait_for_agents(job.proc, timeout=FIRST_STEP_S, settle=2.0)


def _app_for(
    app_class: type[TorchtopApp], agents: list[AgentInfo], log_path: Path, leaving: Leaving
) -> TorchtopApp:
    """The job view when the agents are the ranks of one job (torchrun), else the one-agent view
    (a chooser for several)."""
    from torchtop.monitor.tui.app import TorchtopApp
    from torchtop.monitor.tui.job_app import JobApp
    from torchtop.monitor.tui.job_launch import job_plan_of

    plan = job_plan_of(agents)
    if plan is not None and app_class is TorchtopApp:
        return JobApp(plan, log_path=log_path, leaving=leaving)
    return app_class(None, agents, log_path=log_path, leaving=leaving)


def _close_when_done(job: Job, app: TorchtopApp) -> None:
    """After a signal was passed on during the TUI: close the TUI once the job has ended, so that
    the launcher returns the job's status (what a scheduler waits for)."""

    def watch() -> None:
        while not job.ended():
            time.sleep(0.1)
        try:
            app.call_from_thread(app.exit)
        except Exception:
            pass  # the TUI has closed already

    threading.Thread(target=watch, name="torchtop-run-watch", daemon=True).start()


def _run_headless(command: list[str], env: dict[str, Any]) -> int:
    with ExitStack() as stack:
        try:
            job = stack.enter_context(started(command, env))
        except OSError as exc:
            print(f"torchtop: cannot run {command[0]!r}: {exc.strerror or exc}", file=sys.stderr)
            return 127
        print(
            f"torchtop run: pid {job.pid}; attach with `torchtop attach` (or `torchtop ls` for every rank)",
            file=sys.stderr,
            flush=True,
        )
        return _finish(job)
