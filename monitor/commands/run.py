"""`torchtop run -- CMD...`: run a training command with the agent injected, no code change.

The child gets TORCHTOP=1 and torchtop's bootstrap `sitecustomize` first on PYTHONPATH (it arms
the agent's autostart, then runs whatever sitecustomize the environment already had), so any
Python process of the job that imports torch starts an agent: `python train.py`, `python -m
pkg.train`, every rank of `torchrun` (not the launcher). With the TUI the job's output goes to a
log file, shown in the TUI's Log tab; with --no-tui it stays on this terminal. The job runs in
its own process group: SIGTERM, SIGHUP and SIGINT sent to `torchtop run` are passed on to it
(a scheduler's SIGTERM stops the job, not only the launcher), a Ctrl-C at the terminal reaches
it once, and the exit code is the job's (128 + N when a signal N ended it). The TUI closes once
the job has ended or the terminal hung up (SIGHUP); a failure of the monitor side is one line,
never the job's end.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import subprocess
import sys
import termios
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
LEAVE_GRACE_S = 5.0  # the TUI asked to close and still open: a hung-up terminal holds it


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


def stopping_line(pid: int) -> str:
    """After Ctrl-C in the TUI: the job may take a while (a non-daemon thread keeps a Python job
    alive past its KeyboardInterrupt); the terminal is the job's again, so a second Ctrl-C reaches it."""
    return (
        f"torchtop: Ctrl-C: SIGINT sent to the job (pid {pid}); waiting for it to end "
        "(if its threads hold it up, press Ctrl-C again: the second one reaches the job too)"
    )


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
    job.on_forward = _on_signal
    try:
        return _watch(job, log_path, app_class)
    except Exception as exc:  # broad: the monitor side failed: it never takes the job down with it
        try:
            print(
                f"torchtop: the monitor stopped ({type(exc).__name__}: {str(exc)[:200]}); the job goes "
                f"on (pid {job.pid}), its output: {log_path}",
                file=sys.stderr,
                flush=True,
            )
        except OSError:
            pass  # no terminal to say it on
        return _finish(job)


def _watch(job: Job, log_path: Path, app_class: type[TorchtopApp]) -> int:
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

    app: TorchtopApp | None = None
    if job.forwarded is None:  # not told to stop meanwhile
        app = _app_for(app_class, wait_for_ranks(job.proc, agents), log_path, Leaving("run", stop_job))
        leave = _Leave(job, app)
        job.on_forward = leave.on_forward
        try:
            app.run()
        finally:
            job.on_forward = _on_signal
            leave.done()
    last = last_verdict(app) if app is not None else ""
    if last:  # the TUI closed with the job: its last verdict stays in the terminal's scrollback
        print(last, flush=True)
    if stopped:
        print(stopping_line(job.pid), flush=True)
    elif job.ended():
        print(f"torchtop run: the job ended (exit code {_exit_code(job.wait())}); its output: {log_path}")
    elif job.poll() is None:
        print(
            f"torchtop: the job goes on (pid {job.pid}); its output: {log_path}\n"
            f"          attach again with `torchtop attach {agents[0].pid}`; Ctrl-C stops the job",
            flush=True,
        )
    return _finish(job)


def last_verdict(app: TorchtopApp) -> str:
    """The TUI's last verdict in a line ("" none yet): the job's where it watched a job."""
    from torchtop.monitor.diagnosis.catalogue import VERDICT_WORDS

    d = getattr(app, "job_diagnosis", None) or app.diagnosis
    if d is None or d.verdict.kind == "unknown":
        return ""
    v = d.verdict
    headline = VERDICT_WORDS.get(v.kind, (v.kind, ""))[0]
    first = next((e for e in v.evidence if not e.startswith("ended:")), "")
    return f"torchtop run: last verdict: {headline} ({v.severity}){': ' + first if first else ''}"


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


class _Leave:
    """Closes the TUI once the job has ended or the terminal is gone (SIGHUP), so the launcher
    returns the job's status; should the TUI not close (Textual stuck on a hung-up terminal), ends
    the launcher itself with that status once the job has ended."""

    def __init__(self, job: Job, app: TorchtopApp) -> None:
        self.job, self.app = job, app
        self.hangup = threading.Event()
        self.left = threading.Event()  # the main thread is out of app.run()
        self.lock = threading.Lock()
        threading.Thread(target=self._watch, name="torchtop-run-watch", daemon=True).start()

    def on_forward(self, signum: int) -> None:
        """In the launcher's signal handler (main thread), after the signal went to the job."""
        if signum == signal.SIGHUP:
            _drop_hung_up_terminal()
            self.hangup.set()

    def done(self) -> None:
        with self.lock:
            self.left.set()

    def _watch(self) -> None:
        while not (self.job.ended() or self.hangup.is_set()):
            if self.left.wait(0.2):
                return
        threading.Thread(target=self._close_app, name="torchtop-run-close", daemon=True).start()
        if self.left.wait(LEAVE_GRACE_S):
            return
        while not self.job.ended():  # a job that outlives a hangup: its status once it ends
            time.sleep(0.2)
        with self.lock:
            if not self.left.is_set():
                os._exit(_exit_code(self.job.wait()))

    def _close_app(self) -> None:
        try:
            self.app.call_from_thread(self.app.exit)
        except Exception:  # broad: the TUI may have closed already, any way
            pass  # the TUI has closed already


def _on_signal(signum: int) -> None:
    """Outside the TUI, after a signal went to the job: a hangup leaves nothing to write to."""
    if signum == signal.SIGHUP:
        _drop_hung_up_terminal()


def _drop_hung_up_terminal() -> None:
    """Point the standard descriptors whose terminal hung up at /dev/null: the TUI's writer and
    our last lines then neither fail nor block on it (a redirected one is left as it is)."""
    try:
        null = os.open(os.devnull, os.O_RDWR)
    except OSError:
        return
    for fd in (0, 1, 2):
        try:
            termios.tcgetattr(fd)
        except termios.error as exc:
            if exc.args and exc.args[0] == errno.EIO:  # a hung-up terminal (ENOTTY: not one)
                try:
                    os.dup2(null, fd)
                except OSError:
                    pass
    os.close(null)


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
