"""The one end-to-end test: `torchtop demo` in a real terminal (tmux), read as a user reads it.

A detached tmux session of fixed size runs the launcher, which starts the balanced demo and opens
the TUI. The test reads the screen with `capture-pane` until the step panel shows a non-zero
step time and the phase table names the phases, presses `q`, and checks that the session ends
and that neither the demo nor its loader workers are left behind. The pane's stderr is never
redirected: Textual draws on it.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from torchtop.agent.contract import discovery

pytestmark = [pytest.mark.slow, pytest.mark.tmux, pytest.mark.phase_sampling]

COLS, ROWS = 120, 40
SCREEN_TIMEOUT_S = 90.0
EXIT_TIMEOUT_S = 20.0
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


def test_demo_in_tmux_shows_live_panels_and_quits_cleanly(tmp_path: Path, runtime_dir: Path) -> None:
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
    screen = ""
    try:
        tmux(
            "new-session",
            "-d",
            "-s",
            session,
            "-x",
            str(COLS),
            "-y",
            str(ROWS),
            "-e",
            f"TORCHTOP_RUNTIME_DIR={runtime_dir}",
            command,
        )
        deadline = time.monotonic() + SCREEN_TIMEOUT_S
        while time.monotonic() < deadline:
            screen = tmux.screen(session)
            if not pids:
                pids = [a["pid"] for a in discovery.list_agents()]
            step_ms = step_time_shown(screen)
            if step_ms and phases_shown(screen) == list(PHASE_ROWS):
                break
            if not tmux.alive(session):
                break
            time.sleep(0.5)
        logs_text = "\n".join(p.read_text() for p in logs.glob("*.log"))
        assert tmux.alive(session), (
            f"the launcher exited early (rc {rc_file.read_text().strip() if rc_file.exists() else '?'}); "
            f"its last screen:\n{screen}\ndemo log:\n{logs_text}"
        )
        assert (step_ms := step_time_shown(screen)) and step_ms > 0, f"no step time on screen:\n{screen}"
        assert phases_shown(screen) == list(PHASE_ROWS), f"phase rows missing:\n{screen}"
        assert re.search(r"\bsteps in window\b", screen), screen

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
