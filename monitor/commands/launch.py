"""Starting a training job as a child process with its output in a log file, finding its
agent, passing signals on to it and stopping it in order: shared by `torchtop demo` and
`torchtop run`. No torch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchtop.contract.discovery import AgentInfo

START_TIMEOUT_S = 90.0
STOP_GRACE_S = 5.0
KEEP_LOGS = 20


class LaunchError(Exception):
    """The job could not be started; the message says why and what to do."""


# -- log file ------------------------------------------------------------------------------------
def log_dirs(explicit: str | None) -> list[Path]:
    """Where a job's log may go, in order of preference."""
    if explicit:
        return [Path(explicit).expanduser()]
    out = []
    state = os.environ.get("XDG_STATE_HOME")
    if state:
        out.append(Path(state) / "torchtop" / "logs")
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    out.append(Path(cache) / "torchtop" / "logs")
    uid = os.getuid() if hasattr(os, "getuid") else 0
    out.append(Path(tempfile.gettempdir()) / f"torchtop-{uid}" / "logs")
    return out


def open_log(name: str, explicit_dir: str | None, kind: str = "demo") -> tuple[Path, Any]:
    """Create a new log file (0600) in the first usable directory; LaunchError if none is."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    tried = []
    for directory in log_dirs(explicit_dir):
        path = directory / f"{kind}-{name}-{stamp}-{os.getpid()}.log"
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as exc:
            tried.append(f"{directory} ({exc.strerror or exc})")
            continue
        _prune(directory, kind)
        return path, os.fdopen(fd, "wb")
    hint = "pass --log-dir to a writable directory" if not explicit_dir else "choose a writable --log-dir"
    raise LaunchError(f"cannot create the {kind}'s log file: tried {'; '.join(tried)}; {hint}")


def _prune(directory: Path, kind: str) -> None:
    """Keep the newest KEEP_LOGS logs of this kind."""
    try:
        logs = sorted(directory.glob(f"{kind}-*.log"), key=lambda p: p.stat().st_mtime)
        for old in logs[:-KEEP_LOGS]:
            old.unlink()
    except OSError:
        pass


def log_tail(path: Path, lines: int = 15) -> list[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return list(deque((line.rstrip("\n") for line in fh), maxlen=lines))
    except OSError:
        return []


# -- the child -----------------------------------------------------------------------------------
def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the launcher dies, even by SIGKILL."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # broad: not Linux, or no ctypes: the child may outlive us
        pass


def _own_group() -> None:
    """In the child before exec: its own process group (signals for the job reach all of it and
    only it), and SIGTERM when the launcher dies (Linux)."""
    os.setpgid(0, 0)
    if sys.platform.startswith("linux"):
        _die_with_parent()


FORWARDED = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


class Job:
    """A training job in its own process group. Signals the launcher gets (a scheduler's SIGTERM,
    a hangup, a kill -INT) are passed on to that group (`started`); the terminal's own keys
    reach it because it is made the terminal's foreground group while it runs (`foreground`)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.forwarded: int | None = None  # the last signal passed on, None while none was
        self.on_forward: Callable[[int], None] | None = None  # called after each, in the handler

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, signum: int = signal.SIGINT) -> None:
        """Send `signum` to the job's whole process group (torchrun and its workers too): the
        hook for a key in the TUI that interrupts the job. Never raises."""
        try:
            os.killpg(self.proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def poll(self) -> int | None:
        return self.proc.poll()

    def ended(self) -> bool:
        """Whether the job has exited, without reaping it (for a thread beside the one that waits)."""
        if self.proc.returncode is not None:
            return True
        try:
            return os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True

    def wait(self) -> int:
        """Wait for the job; its return code (-N: killed by signal N). A job stopped by the
        terminal (Ctrl-Z) stops the launcher too, so the shell's `fg` resumes both."""
        if self.proc.returncode is not None:
            return self.proc.returncode
        while True:
            try:
                pid, status = os.waitpid(self.proc.pid, os.WUNTRACED)
            except ChildProcessError:
                return self.proc.wait()
            if pid == 0:
                continue
            if os.WIFSTOPPED(status):
                _stop_with(self)
                continue
            self.proc.returncode = os.waitstatus_to_exitcode(status)
            return self.proc.returncode


@contextmanager
def started(command: list[str], env: dict[str, str], **popen: Any) -> Iterator[Job]:
    """Start `command` in its own process group; while in use, SIGTERM, SIGHUP and SIGINT sent to
    the launcher are passed on to that group, once each (OSError when it cannot run).

    The handlers are in place before the job starts: a scheduler's SIGTERM at any moment reaches
    the job. A Ctrl-C at the terminal reaches the job once either way: through this handler while
    the launcher holds the terminal, or directly while the job does (`foreground`)."""
    box: list[Job] = []
    early: list[int] = []

    def handler(signum: int, _frame: Any) -> None:
        if not box:
            early.append(signum)
            return
        job = box[0]
        job.forwarded = signum
        job.signal(signum)
        if job.on_forward is not None:
            job.on_forward(signum)

    previous = {s: signal.signal(s, handler) for s in FORWARDED}
    try:
        box.append(Job(subprocess.Popen(command, env=env, preexec_fn=_own_group, **popen)))
        for signum in early:
            handler(signum, None)
        yield box[0]
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


def _terminal() -> int | None:
    """Our terminal's descriptor when we are in its foreground process group, else None."""
    for stream in (sys.stdin, sys.stdout, sys.stderr):
        try:
            fd = stream.fileno()
            if os.isatty(fd) and os.tcgetpgrp(fd) == os.getpgrp():
                return fd
        except (AttributeError, ValueError, OSError):
            continue
    return None


def _set_foreground(fd: int, pgid: int) -> None:
    old = signal.signal(signal.SIGTTOU, signal.SIG_IGN)  # allowed from the background this way
    try:
        os.tcsetpgrp(fd, pgid)
    except OSError:
        pass
    finally:
        signal.signal(signal.SIGTTOU, old)


_held: dict[int, int] = {}  # job pid -> the terminal it holds as foreground group (for Ctrl-Z)


@contextmanager
def foreground(job: Job) -> Iterator[None]:
    """While in use, the job's group is the terminal's foreground group, as a shell makes its
    foreground job: Ctrl-C, Ctrl-backslash and Ctrl-Z reach the job (once) and it can read the terminal.
    Nothing happens without a terminal or when we are not in its foreground ourselves."""
    fd = _terminal()
    if fd is None:
        yield
        return
    _set_foreground(fd, job.pid)
    _held[job.pid] = fd
    try:
        yield
    finally:
        _held.pop(job.pid, None)
        _set_foreground(fd, os.getpgrp())


def _stop_with(job: Job) -> None:
    """The job stopped (Ctrl-Z): take the terminal back, stop as the shell expects, and on `fg`
    give it back and continue the job (`bg`: the job continues in the background)."""
    fd = _held.get(job.pid)
    if fd is None:
        return  # stopped by someone else, not from our terminal: theirs to continue
    _set_foreground(fd, os.getpgrp())
    os.kill(os.getpid(), signal.SIGSTOP)  # the shell sees its job stopped; we resume on SIGCONT
    try:
        if os.tcgetpgrp(fd) == os.getpgrp():
            _set_foreground(fd, job.pid)
    except OSError:
        pass
    job.signal(signal.SIGCONT)


def _family(pid: int) -> set[int]:
    """pid and its descendants (torchrun's workers are the launcher's children)."""
    try:
        import psutil

        return {pid} | {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except Exception:  # broad: psutil missing or the process gone: the pid alone
        return {pid}


def wait_for_agents(
    child: subprocess.Popen, timeout: float = START_TIMEOUT_S, settle: float = 0.0
) -> list[AgentInfo]:
    """Discovery entries of agents in the child or its descendants, lowest rank first.

    [] if the child exits first; TimeoutError after `timeout`. Once one agent shows up, waits
    `settle` seconds more for its siblings (the other ranks of a torchrun job).
    """
    from torchtop.contract import discovery

    deadline = time.monotonic() + timeout
    found: list[AgentInfo] = []
    settled_at = None
    while True:
        if child.poll() is not None:
            return found
        family = _family(child.pid)
        found = [a for a in discovery.list_agents() if a.pid in family and a.unusable is None]
        if found and settled_at is None:
            settled_at = time.monotonic() + settle
        if found and settled_at is not None and time.monotonic() >= settled_at:
            return sorted(found, key=lambda a: (a.rank or 0, a.pid or 0))
        if time.monotonic() >= deadline:
            if found:
                return found
            raise TimeoutError(
                f"no process of the job (pid {child.pid}) listed a torchtop agent within {timeout:.0f} s "
                "(an agent started with TORCHTOP=1 is listed once its process runs a model)"
            )
        time.sleep(0.1)


def wait_for_ranks(
    child: subprocess.Popen, agents: list[AgentInfo], timeout: float = START_TIMEOUT_S
) -> list[AgentInfo]:
    """When the first agents found are ranks of a job, wait (up to `timeout`) for the job's
    other ranks on this machine: its local world size, else its world size."""
    want = max((a.local_world_size or a.world_size or 1 for a in agents), default=1)
    deadline = time.monotonic() + timeout
    while len(agents) < want and time.monotonic() < deadline and child.poll() is None:
        time.sleep(0.2)
        agents = wait_for_agents(child, timeout=max(0.1, deadline - time.monotonic())) or agents
    return agents


def stop_child(child: subprocess.Popen, grace: float = STOP_GRACE_S) -> int:
    """SIGTERM (the demo ends after its current step), SIGKILL to its process group after `grace`."""
    if child.poll() is None:
        try:
            child.send_signal(signal.SIGTERM)
            child.wait(grace)
        except subprocess.TimeoutExpired:
            pass
        except OSError:
            pass
    # Whatever is left of its process group (a stuck demo, orphaned loader workers) is killed.
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, OSError):
        pass
    return child.wait()


def _show_tail(log_path: Path, why: str) -> None:
    print(f"torchtop: {why}; the last lines of {log_path}:", file=sys.stderr)
    for line in log_tail(log_path):
        print(f"  | {line}", file=sys.stderr)
