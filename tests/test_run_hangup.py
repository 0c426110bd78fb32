"""`torchtop run` under a closing terminal, and with a monitor side that fails (issue 37).

The launcher holds the terminal for its TUI; the job runs in its own process group. When the
terminal hangs up (a tmux pane or an ssh session closed), the launcher passes SIGHUP on, leaves
the TUI and returns the job's status, reaping it; SIGTERM always ends it. A job that ends on its
own closes the TUI the same way. Nothing the monitor side meets (a hostile discovery file, an
error of its own) takes the job down: it says so in a line and waits for the job.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import termios
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from torchtop.contract import discovery
from torchtop.monitor.commands import run as run_cmd
from torchtop.monitor.commands.launch import started

EXIT_S = 30.0  # generous: the launcher leaves within seconds of a hangup

JOB = textwrap.dedent(
    """
    import os, signal, sys, time, torch
    if os.environ.get("JOB_KEEPS_ON_HANGUP"):
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(5))
    stop = os.environ.get("JOB_STOP_FILE")  # a file: the test's word to end now (as on its own)
    model = torch.nn.Linear(32, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    end = time.monotonic() + float(sys.argv[1])
    while time.monotonic() < end and not (stop and os.path.exists(stop)):
        loss = model(torch.randn(16, 32)).square().mean()
        opt.zero_grad(); loss.backward(); opt.step()
        time.sleep(0.01)
    print("job: done", flush=True)
    sys.exit(int(sys.argv[2]))
    """
)


class Terminal:
    """A pseudo-terminal the launcher takes as its controlling terminal; closing it hangs up."""

    def __init__(self) -> None:
        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        self.slave = slave
        self.output = bytearray()

    def spawn(self, cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        def take_terminal() -> None:  # in the child: a new session whose terminal this is
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        proc = subprocess.Popen(
            cmd,
            stdin=self.slave,
            stdout=self.slave,
            stderr=self.slave,
            start_new_session=True,
            preexec_fn=take_terminal,
            env=dict(env, TERM="xterm-256color"),
        )
        os.close(self.slave)
        threading.Thread(target=self._read, daemon=True).start()
        return proc

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:
                return
            if not data:
                return
            self.output += data

    def wait_for(self, text: bytes, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output:
            assert time.monotonic() < deadline, bytes(self.output[-2000:])
            time.sleep(0.1)

    def hang_up(self) -> None:
        os.close(self.master)


def _launcher(script: Path, logs: Path, *job_args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torchtop.monitor.commands.cli",
        "run",
        "--log-dir",
        str(logs),
        "--",
        sys.executable,
        str(script),
        *job_args,
    ]


def _reaped(pid: int, timeout: float = 10) -> bool:
    """Gone: not even a zombie left for someone to wait for."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            psutil.Process(pid)
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def _job_pid(launcher: subprocess.Popen[bytes] | int, timeout: float = 120) -> int:
    pid = launcher if isinstance(launcher, int) else launcher.pid
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for agent in discovery.list_agents():
            try:
                if agent.pid is not None and psutil.Process(agent.pid).ppid() == pid:
                    return agent.pid
            except psutil.NoSuchProcess:
                continue
        time.sleep(0.2)
    raise AssertionError("the job's agent never showed up")


def _kill(*pids: int | None) -> None:
    for pid in pids:
        if pid is not None and psutil.pid_exists(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_failing_monitor_side_never_takes_the_job_down(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(*_: object, **__: object) -> list[discovery.AgentInfo]:
        raise OverflowError("signed integer is greater than maximum")

    monkeypatch.setattr(run_cmd, "wait_for_agents", broken)
    code = "import sys, time; time.sleep(0.3); print('job: done', flush=True); sys.exit(3)"
    with (
        open(tmp_path / "job.log", "wb") as log,
        started([sys.executable, "-c", code], dict(os.environ), stdout=log) as job,
    ):
        assert run_cmd._run_with_tui(job, tmp_path / "job.log", object) == 3  # type: ignore[arg-type]
    assert "job: done" in (tmp_path / "job.log").read_text()
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "the monitor stopped (OverflowError" in err, err


@pytest.mark.slow
def test_run_with_a_hostile_discovery_file_returns_the_jobs_status(runtime_dir: Path, tmp_path: Path) -> None:
    """A file naming a pid no process can have was the job's end at start (the TUI raised);
    now the TUI opens, and closes when the job ends on its own, with the job's code."""
    (runtime_dir / "agent-1.json").write_text(json.dumps({"pid": 2**31}))
    script = tmp_path / "job.py"
    script.write_text(JOB)
    stop = tmp_path / "stop"
    term = Terminal()
    env = dict(os.environ, JOB_STOP_FILE=str(stop))
    launcher = term.spawn(_launcher(script, tmp_path / "logs", "600", "3"), env)
    try:
        # the job ends on its own once the TUI has judged it (the verdict panel's title counts the
        # steps judged): a run of a fixed 8 s could end before a loaded machine had the TUI up
        term.wait_for(b" judged")
        stop.touch()
        assert launcher.wait(180) == 3, bytes(term.output[-3000:])
        log = "\n".join(p.read_text() for p in (tmp_path / "logs").glob("*.log"))
        assert "job: done" in log, log[-2000:]
        assert b"the job ended (exit code 3)" in term.output
        # the TUI closed with the job: its last verdict stays in the terminal
        assert b"torchtop run: last verdict: " in term.output, bytes(term.output[-3000:])
    finally:
        _kill(launcher.pid)
        term.hang_up()


@pytest.mark.slow
def test_a_hangup_ends_the_launcher_with_the_jobs_status_and_reaps_it(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    term = Terminal()
    launcher = term.spawn(_launcher(script, tmp_path / "logs", "600", "0"), dict(os.environ))
    job = None
    try:
        job = _job_pid(launcher)
        term.wait_for(b"step time")  # the TUI is up and holds the terminal
        term.hang_up()
        assert launcher.wait(EXIT_S) == 128 + signal.SIGHUP  # the job ended on the hangup passed on
        assert _reaped(job), "the job was left a zombie"
    finally:
        _kill(launcher.pid, job)


@pytest.mark.slow
def test_sigterm_ends_the_launcher_after_a_hangup_the_job_outlived(tmp_path: Path) -> None:
    """The job ignores SIGHUP and goes on; the launcher, its terminal gone, waits for it; a
    scheduler's SIGTERM reaches the job and the launcher returns the job's own code."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    term = Terminal()
    env = dict(os.environ, JOB_KEEPS_ON_HANGUP="1")
    launcher = term.spawn(_launcher(script, tmp_path / "logs", "600", "0"), env)
    job = None
    try:
        job = _job_pid(launcher)
        term.wait_for(b"step time")
        term.hang_up()
        time.sleep(3)
        assert launcher.poll() is None and psutil.pid_exists(job)  # the job goes on, and so does its wait
        os.kill(launcher.pid, signal.SIGTERM)
        assert launcher.wait(EXIT_S) == 5  # the job's own exit on SIGTERM
        assert _reaped(job), "the job was left a zombie"
    finally:
        _kill(launcher.pid, job)


@pytest.mark.slow
@pytest.mark.tmux
@pytest.mark.parametrize("close", ["kill-pane", "kill-session"])
def test_closing_the_tmux_pane_ends_the_launcher_and_reaps_the_job(
    tmp_path: Path, runtime_dir: Path, close: str
) -> None:
    from tests.test_tmux import Tmux, new_session, step_time_shown, wait_screen

    if shutil.which("tmux") is None:
        pytest.skip("needs tmux")
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = dict(os.environ, TORCHTOP_RUNTIME_DIR=str(runtime_dir), TERM="xterm-256color")
    tmux = Tmux(env)
    session = "hangup"
    launcher = job = None
    try:
        new_session(
            tmux,
            session,
            (100, 30),
            runtime_dir,
            shlex.join(_launcher(script, tmp_path / "logs", "600", "0")),
        )
        screen = wait_screen(tmux, session, lambda text: bool(step_time_shown(text)))
        assert step_time_shown(screen), f"no steps on screen:\n{screen}"
        (agent,) = discovery.list_agents()
        job = agent.pid
        assert job is not None
        launcher = psutil.Process(job).ppid()
        tmux(close, "-t", session)
        deadline = time.monotonic() + EXIT_S
        while time.monotonic() < deadline and _running(launcher):
            time.sleep(0.2)
        assert not _running(launcher), "the launcher outlived its terminal"
        assert _reaped(job), "the job was left a zombie"
    finally:
        tmux.kill_server()
        _kill(launcher, job)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
