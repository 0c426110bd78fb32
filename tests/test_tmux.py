"""End to end in a real terminal (tmux), read as a user reads it: `torchtop demo`, and Ctrl-C in
the TUI of `torchtop run`.

A detached tmux session of fixed size runs the launcher, which starts the job and opens the TUI.
The demo test runs at 80x24 (many terminals' and tmux panes' default) and 120x40: it reads the
screen with `capture-pane` until the step panel shows a non-zero step time, presses PageDown (at
80x24 the phase table is below the fold) until the phase table names the phases, checks that
nothing but blanks lies beside the panels, presses `q`, and checks that the session ends and
that neither the demo nor its loader workers are left behind. The pane's stderr is never
redirected: Textual draws on it.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest

from tests.tui_util import outside_the_panels
from torchtop.contract import discovery

pytestmark = [pytest.mark.slow, pytest.mark.tmux, pytest.mark.phase_sampling]

SIZES = [(80, 24), (120, 40)]
SCREEN_TIMEOUT_S = 90.0
EXIT_TIMEOUT_S = 60.0  # a deadline, not the time it takes: a loaded machine stops a job's processes slowly
PHASE_ROWS = ("data", "forward", "backward", "optimizer")


def _torchtop() -> list[str]:
    script = Path(sys.executable).with_name("torchtop")
    return [str(script)] if script.exists() else [sys.executable, "-m", "torchtop.monitor.commands.cli"]


class Tmux:
    """A private tmux server (its own socket), so the test touches no one else's sessions."""

    def __init__(self, env: dict[str, str]) -> None:
        self.socket = f"torchtop-test-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.env = env

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["tmux", "-L", self.socket, *args],
            capture_output=True,
            text=True,
            env=self.env,
            check=check,
            timeout=15,
        )

    def alive(self, session: str) -> bool:
        return self("has-session", "-t", session, check=False).returncode == 0

    def screen(self, session: str) -> str:
        proc = self("capture-pane", "-p", "-t", session, check=False)
        return proc.stdout if proc.returncode == 0 else ""

    def kill_server(self) -> None:
        self("kill-server", check=False)


def step_time_shown(screen: str) -> float | None:
    """The `now N ms` figure of the step panel, or None while it is not on screen."""
    if "step time" not in screen:
        return None
    m = re.search(r"\bnow\s+([\d,]+(?:\.\d+)?)\s*ms\b", screen)
    return float(m.group(1).replace(",", "")) if m else None


def phases_shown(screen: str) -> list[str]:
    """The phases whose table row (name, then ms per step) is on screen."""
    return [p for p in PHASE_ROWS if re.search(rf"\b{p}\s+[\d,]+(?:\.\d+)?\s", screen)]


def new_session(tmux: Tmux, session: str, size: tuple[int, int], runtime_dir: Path, command: str) -> None:
    cols, rows = size
    tmux(
        "new-session",
        "-d",
        "-s",
        session,
        "-x",
        str(cols),
        "-y",
        str(rows),
        "-e",
        f"TORCHTOP_RUNTIME_DIR={runtime_dir}",
        command,
    )


def wait_screen(tmux: Tmux, session: str, done, timeout: float = SCREEN_TIMEOUT_S) -> str:  # type: ignore[no-untyped-def]
    """The pane's text once `done(text)` holds, or the last one seen if the session ended; a
    timeout fails the test (a condition that never holds must not pass after the whole wait)."""
    deadline = time.monotonic() + timeout
    screen = ""
    while time.monotonic() < deadline:
        screen = tmux.screen(session)
        if done(screen) or not tmux.alive(session):
            return screen
        time.sleep(0.5)
    pytest.fail(f"the screen did not show what was waited for in {timeout:.0f} s:\n{screen}")


@pytest.mark.parametrize("size", SIZES, ids=[f"{c}x{r}" for c, r in SIZES])
def test_demo_in_tmux_shows_live_panels_and_quits_cleanly(
    tmp_path: Path, runtime_dir: Path, size: tuple[int, int]
) -> None:
    if shutil.which("tmux") is None:
        pytest.skip("needs tmux")
    env = dict(os.environ, TORCHTOP_RUNTIME_DIR=str(runtime_dir), TERM="xterm-256color")
    rc_file = tmp_path / "rc"
    logs = tmp_path / "logs"
    launcher = shlex.join([*_torchtop(), "demo", "--device", "cpu", "--log-dir", str(logs)])
    # The exit status goes to a file so a failure can be reported after the pane has closed.
    command = f"{launcher}; echo $? > {shlex.quote(str(rc_file))}"
    tmux = Tmux(env)
    session = "demo"
    pids: list[int] = []
    try:
        new_session(tmux, session, size, runtime_dir, command)
        # the TUI opens once the job runs its model: steps show at once, the footer a frame later
        screen = wait_screen(
            tmux, session, lambda text: bool(step_time_shown(text)) and "Quit+stop demo" in text
        )
        pids = [a.pid for a in discovery.list_agents() if a.pid is not None]
        logs_text = "\n".join(p.read_text() for p in logs.glob("*.log"))
        assert tmux.alive(session), (
            f"the launcher exited early (rc {rc_file.read_text().strip() if rc_file.exists() else '?'}); "
            f"its last screen:\n{screen}\ndemo log:\n{logs_text}"
        )
        assert (step_ms := step_time_shown(screen)) and step_ms > 0, f"no step time on screen:\n{screen}"
        assert re.search(r"\bsteps in window\b", screen), screen
        assert re.search(r"\btorch \d+\.\d+", screen), f"the header lost the torch version:\n{screen}"
        assert "Quit+stop demo" in screen, screen  # the footer says what q does here

        def phases(text: str) -> bool:
            shown = phases_shown(text)
            if shown == list(PHASE_ROWS):
                return True
            # below the fold at 80x24: a line at a time (a page overshot the table when the panels
            # above it grew on a loaded machine), back a line when the first rows went above
            tmux("send-keys", "-t", session, "Up" if shown and shown[0] != PHASE_ROWS[0] else "Down")
            return False

        screen = wait_screen(tmux, session, phases)  # a loaded TUI takes the keys late: it may overshoot
        assert phases_shown(screen) == list(PHASE_ROWS), f"phase rows missing after PageDown:\n{screen}"
        assert outside_the_panels(screen) == [], f"stray glyphs beside the panels:\n{screen}"

        assert len(pids) == 1, f"expected the demo's agent in {runtime_dir}, found pids {pids}"
        pids += [c.pid for c in psutil.Process(pids[0]).children(recursive=True)]

        tmux("send-keys", "-t", session, "q")
        deadline = time.monotonic() + EXIT_TIMEOUT_S
        while tmux.alive(session) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not tmux.alive(session), f"the session is still open after q:\n{tmux.screen(session)}"
        assert rc_file.read_text().strip() == "0"
        left = [p for p in pids if _running(p)]
        assert left == [], f"processes left behind after q: {left}"
        assert discovery.list_agents() == []
    finally:
        tmux.kill_server()
        for pid in pids:
            _kill_demo(pid)


#: A training script that says how it ended: Ctrl-C must reach it as a KeyboardInterrupt.
JOB = """
import sys, time, torch
model = torch.nn.Linear(32, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
try:
    while True:
        loss = model(torch.randn(16, 32)).square().mean()
        opt.zero_grad(); loss.backward(); opt.step()
        time.sleep(0.01)
except KeyboardInterrupt:
    print("job: KeyboardInterrupt", flush=True)
    sys.exit(7)
"""


def test_ctrl_c_in_the_tui_of_torchtop_run_stops_the_job(tmp_path: Path, runtime_dir: Path) -> None:
    """The TUI holds the terminal in raw mode, so Ctrl-C is a key, not a SIGINT: the TUI must pass
    it on to the job, and `torchtop run` then exits with the job's own code."""
    if shutil.which("tmux") is None:
        pytest.skip("needs tmux")
    env = dict(os.environ, TORCHTOP_RUNTIME_DIR=str(runtime_dir), TERM="xterm-256color")
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    rc_file = tmp_path / "rc"
    logs = tmp_path / "logs"
    launcher = shlex.join([*_torchtop(), "run", "--log-dir", str(logs), "--", sys.executable, str(script)])
    command = f"{launcher}; echo $? > {shlex.quote(str(rc_file))}"
    tmux = Tmux(env)
    session = "run"
    pids: list[int] = []
    try:
        new_session(tmux, session, (80, 24), runtime_dir, command)
        # the TUI opens once the job runs its model: steps show at once, the footer a frame later
        # (run's footer word for Ctrl-C: a word it never shows would wait out the whole timeout)
        screen = wait_screen(tmux, session, lambda text: bool(step_time_shown(text)) and "Stop job" in text)
        pids = [a.pid for a in discovery.list_agents() if a.pid is not None]
        assert step_time_shown(screen), f"no steps on screen:\n{screen}"
        tmux("send-keys", "-t", session, "C-c")
        deadline = time.monotonic() + EXIT_TIMEOUT_S
        while not rc_file.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        log = "\n".join(p.read_text() for p in logs.glob("*.log"))
        assert rc_file.exists(), f"still running after Ctrl-C:\n{tmux.screen(session)}\njob log:\n{log}"
        assert rc_file.read_text().strip() == "7", log  # the job's own code, after its KeyboardInterrupt
        assert "job: KeyboardInterrupt" in log
        assert [p for p in pids if _running(p)] == []
        assert "Stop job" in screen, screen  # and the footer said what Ctrl-C would do
    finally:
        tmux.kill_server()
        for pid in pids:
            if _running(pid):
                psutil.Process(pid).kill()


def _left_running(tmux: Tmux, session: str, rc_file: Path) -> None:
    """After q under `run`: the TUI closes, says the job goes on, and the launcher waits for the
    job to end by itself (it has not returned a second later)."""
    wait_screen(tmux, session, lambda text: "the job goes on" in text, timeout=EXIT_TIMEOUT_S)
    time.sleep(1.0)
    assert not rc_file.exists(), f"the launcher returned after q:\n{tmux.screen(session)}"


def ranks_listed(screen: str) -> set[int]:
    """The ranks whose row (rank, node, a step time) the Ranks panel shows with live figures."""
    rows = re.findall(r"^\W*(\d+)\s+\S+\s+[\d,]+(?:\.\d+)?\s", screen, re.MULTILINE)
    return {int(r) for r in rows}


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _kill_demo(pid: int) -> None:
    """Kill a leftover demo process (checked by its command line: the pid may have been reused)."""
    try:
        proc = psutil.Process(pid)
        if any("torchtop.demos" in part for part in proc.cmdline()):
            proc.kill()
    except psutil.Error:
        pass


@pytest.mark.parametrize("key", ["q", "C-c"])
def test_torchrun_under_torchtop_run_opens_the_job_view_in_tmux(
    tmp_path: Path, runtime_dir: Path, key: str
) -> None:
    """The README's multi-GPU command, `torchtop run -- torchrun ...`, with its TUI: the job view
    comes up naming both ranks; q closes the view and leaves the job running (the launcher waits
    for it and returns its 0 once it ends), Ctrl-C stops it; either way no rank is left behind
    once the launcher returns."""
    if shutil.which("tmux") is None:
        pytest.skip("needs tmux")
    stop, env = _package(tmp_path, runtime_dir)
    rc_file = tmp_path / "rc"
    logs = tmp_path / "logs"
    launcher = shlex.join(
        [
            *_torchtop(), "run", "--log-dir", str(logs), "--",
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "-m", "pkg.ddp",
        ]
    )  # fmt: skip
    command = f"{launcher}; echo $? > {shlex.quote(str(rc_file))}"
    tmux = Tmux(env)
    session = "torchrun"
    pids: list[int] = []
    try:
        new_session(tmux, session, (120, 40), runtime_dir, command)
        screen = wait_screen(tmux, session, lambda text: ranks_listed(text) == {0, 1})
        pids = [a.pid for a in discovery.list_agents() if a.pid is not None]
        log = "\n".join(p.read_text() for p in logs.glob("*.log"))
        assert tmux.alive(session), (
            f"the launcher exited (rc {rc_file.read_text().strip() if rc_file.exists() else '?'}):\n"
            f"{screen}\njob log:\n{log[-3000:]}"
        )
        assert "Traceback" not in screen and "NameError" not in screen, screen
        assert ranks_listed(screen) == {0, 1}, f"the job view does not list both ranks:\n{screen}"
        assert len(pids) == 2, f"expected the 2 ranks' agents, found {pids}"
        tmux("send-keys", "-t", session, key)
        if key == "q":
            _left_running(tmux, session, rc_file)
            assert all(_running(p) for p in pids), "q stopped a rank"
            stop.touch()
        deadline = time.monotonic() + (120 if key == "q" else EXIT_TIMEOUT_S)
        while not rc_file.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        log = "\n".join(p.read_text() for p in logs.glob("*.log"))
        assert rc_file.exists(), (
            f"still running after {key}:\n{tmux.screen(session)}\njob log:\n{log[-3000:]}"
        )
        if key == "q":
            assert rc_file.read_text().strip() == "0", log[-3000:]  # the job ran to its end
            assert log.count("job: done") == 2, log[-3000:]
        else:
            assert rc_file.read_text().strip() != "0", log[-3000:]  # stopped, not finished
            assert "job: done" not in log, log[-3000:]
        assert [p for p in pids if _running(p)] == []
    finally:
        stop.touch()
        tmux.kill_server()
        for pid in pids:
            if _running(pid):
                psutil.Process(pid).kill()


#: A module for `python -m`: a light job that ends by itself once the test creates $JOB_STOP (q
#: leaves it running under `run`; the file lets the test check it is still running first, and end
#: it without waiting out a fixed length).
MODULE = """
import os, time, torch
model = torch.nn.Linear(32, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
end = time.monotonic() + float(os.environ.get("JOB_SECONDS", "300"))
while time.monotonic() < end and not os.path.exists(os.environ["JOB_STOP"]):
    loss = model(torch.randn(16, 32)).square().mean()
    opt.zero_grad(); loss.backward(); opt.step()
    time.sleep(0.01)
print("job: done", flush=True)
"""

#: The same under torchrun: two DDP ranks (gloo), each ending once $JOB_STOP exists.
DDP_MODULE = """
import os, time, torch
import torch.distributed as dist
dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
end = time.monotonic() + float(os.environ.get("JOB_SECONDS", "300"))
while True:
    go = torch.tensor([float(time.monotonic() < end and not os.path.exists(os.environ["JOB_STOP"]))])
    dist.all_reduce(go)  # every rank stops at the same step
    if go.item() < dist.get_world_size():
        break
    loss = model(torch.randn(16, 32)).square().mean()
    opt.zero_grad(); loss.backward(); opt.step()
    time.sleep(0.01)
dist.destroy_process_group()
print("job: done", flush=True)
"""


def _package(tmp_path: Path, runtime_dir: Path) -> tuple[Path, dict[str, str]]:
    """tmp_path/pkg with the two jobs, `pkg.train` and `pkg.ddp`, for `python -m`; the file that
    ends them (not there yet) and the environment they and the TUI run in."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(textwrap.dedent(MODULE))
    (pkg / "ddp.py").write_text(textwrap.dedent(DDP_MODULE))
    stop = tmp_path / "stop"
    env = dict(
        os.environ,
        TORCHTOP_RUNTIME_DIR=str(runtime_dir),
        TERM="xterm-256color",
        PYTHONPATH=str(tmp_path),
        JOB_STOP=str(stop),
    )
    return stop, env


@pytest.mark.parametrize("form", ["run -- python -m", "attach"])
def test_the_readmes_other_tui_forms_in_tmux(tmp_path: Path, runtime_dir: Path, form: str) -> None:
    """`torchtop run -- python -m pkg.train` with its TUI, and `torchtop attach PID` to a run
    started with TORCHTOP=1: steps on screen, then q. Under `run` the job goes on and the launcher
    returns its code when it ends; under `attach` the run goes on after the monitor quits."""
    if shutil.which("tmux") is None:
        pytest.skip("needs tmux")
    stop, env = _package(tmp_path, runtime_dir)
    rc_file = tmp_path / "rc"
    job = None
    if form == "attach":
        job = subprocess.Popen(
            [sys.executable, "-m", "pkg.train"],
            env=dict(env, TORCHTOP="1"),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while not [a for a in discovery.list_agents() if a.pid == job.pid] and time.monotonic() < deadline:
            time.sleep(0.2)
        launcher = shlex.join([*_torchtop(), "attach", str(job.pid)])
    else:
        launcher = shlex.join(
            [
                *_torchtop(),
                "run",
                "--log-dir",
                str(tmp_path / "logs"),
                "--",
                sys.executable,
                "-m",
                "pkg.train",
            ]
        )
    command = f"{launcher}; echo $? > {shlex.quote(str(rc_file))}"
    tmux = Tmux(env)
    session = "form"
    try:
        new_session(tmux, session, (120, 40), runtime_dir, command)
        screen = wait_screen(tmux, session, lambda text: bool(step_time_shown(text)))
        assert tmux.alive(session), f"the TUI exited early:\n{screen}"
        assert step_time_shown(screen), f"no steps on screen:\n{screen}"
        tmux("send-keys", "-t", session, "q")
        if job is None:
            _left_running(tmux, session, rc_file)
            stop.touch()
        deadline = time.monotonic() + 90
        while not rc_file.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert rc_file.exists(), f"still open after q:\n{tmux.screen(session)}"
        assert rc_file.read_text().strip() == "0"
        if job is not None:
            assert job.poll() is None, "attach's q stopped the run"
        else:
            log = "\n".join(p.read_text() for p in (tmp_path / "logs").glob("*.log"))
            assert "job: done" in log, log[-2000:]  # q left the job running to its end
    finally:
        stop.touch()
        tmux.kill_server()
        if job is not None:
            job.kill()
            job.wait()


def test_replay_of_a_recording_in_tmux(tmp_path: Path, runtime_dir: Path) -> None:
    """`torchtop replay PATH`, the README's last TUI form: the recording plays (its clock on the
    status line, steps on screen) and q leaves with 0."""
    if shutil.which("tmux") is None:
        pytest.skip("needs tmux")
    from tests.recording_util import write

    write(tmp_path / "rec", 60)
    env = dict(os.environ, TORCHTOP_RUNTIME_DIR=str(runtime_dir), TERM="xterm-256color")
    rc_file = tmp_path / "rc"
    launcher = shlex.join([*_torchtop(), "replay", str(tmp_path / "rec")])
    tmux = Tmux(env)
    session = "replay"
    try:
        new_session(
            tmux, session, (120, 40), runtime_dir, f"{launcher}; echo $? > {shlex.quote(str(rc_file))}"
        )
        screen = wait_screen(tmux, session, lambda text: "replay" in text and bool(step_time_shown(text)))
        assert tmux.alive(session), f"replay exited early:\n{screen}"
        assert re.search(r"replay \d+:\d\d / \d+:\d\d", screen), f"no replay clock:\n{screen}"
        assert step_time_shown(screen), f"no steps on screen:\n{screen}"
        tmux("send-keys", "-t", session, "q")
        deadline = time.monotonic() + EXIT_TIMEOUT_S
        while not rc_file.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert rc_file.exists() and rc_file.read_text().strip() == "0", tmux.screen(session)
    finally:
        tmux.kill_server()
