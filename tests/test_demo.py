"""`torchtop demo`: the launcher, the balanced demo it runs, and `torchtop report` on that demo.

Real processes throughout: the launcher as a user runs it (`--no-tui`), the demo training a CNN
on CPU with loader workers, and the report read over loopback.
"""

from __future__ import annotations

import json
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from torchtop.contract.logcodes import PHASES
from torchtop.monitor.commands import demo

pytestmark = [pytest.mark.slow, pytest.mark.phase_sampling]  # subprocesses; the default policy

CLI = [sys.executable, "-m", "torchtop.monitor.commands.cli"]
START_TIMEOUT_S = 90.0


class Lines:
    """A child's stdout, line by line, readable with a deadline."""

    def __init__(self, stream) -> None:  # type: ignore[no-untyped-def]
        self.seen: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream) -> None:  # type: ignore[no-untyped-def]
        for line in stream:
            self._q.put(line.rstrip("\n"))
        self._q.put(None)

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._q.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            self.seen.append(line)
            if m := re.search(pattern, line):
                return m
        raise AssertionError(
            f"no line matching {pattern!r} in {timeout:.0f} s; output so far:\n" + "\n".join(self.seen)
        )


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if not _gone(p)]
        if not alive:
            return []
        time.sleep(0.1)
    return [p for p in pids if not _gone(p)]


def _cleanup(launcher: subprocess.Popen, pids: list[int]) -> None:
    if launcher.poll() is None:
        launcher.kill()
        launcher.wait(10)
    for pid in pids:  # only what is still a demo process: the pid may have been reused
        try:
            proc = psutil.Process(pid)
            if any("torchtop.demos" in part for part in proc.cmdline()):
                proc.kill()
        except psutil.Error:
            pass


def report(pid: int, env: dict[str, str]) -> dict:
    proc = subprocess.run(
        [*CLI, "report", str(pid), "--seconds", "3"], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_no_tui_demo_reports_steps_and_stops_cleanly(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    logs = tmp_path / "logs"
    launcher = subprocess.Popen(
        [*CLI, "demo", "--no-tui", "--device", "cpu", "--seconds", "120", "--log-dir", str(logs)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=subprocess_env,
    )
    out = Lines(launcher.stdout)
    pids: list[int] = []
    try:
        log_path = Path(out.wait_for(r"log: (\S+\.log)$", 30).group(1))
        assert log_path.parent == logs
        pid = int(out.wait_for(r"attach: torchtop attach (\d+)$", START_TIMEOUT_S).group(1))
        pids = [pid]

        # The agent is up before the first step (model, loader workers, first batches): until
        # then a report has the right shape and no steps, so ask again, as a user would.
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            data = report(pid, subprocess_env)
            assert data["pid"] == pid
            assert data["device"] == "cpu"
            assert set(data["breakdown"]) == set(PHASES)
            if data["steps"] > 0 or time.monotonic() > deadline:
                break
        assert data["steps"] > 0, data
        assert data["step_time_ms"]["median"] > 0
        assert set(data["breakdown"]) == set(PHASES)
        assert sum(data["breakdown"].values()) == pytest.approx(1.0, abs=0.01)
        for phase in ("forward", "backward", "optimizer"):
            assert data["breakdown"][phase] > 0, data["breakdown"]

        pids += [c.pid for c in psutil.Process(pid).children(recursive=True)]  # steps ran: workers exist
        assert len(pids) >= 2, "the demo should use DataLoader worker processes"

        launcher.send_signal(signal.SIGINT)  # Ctrl-C
        assert launcher.wait(30) == 130
        assert _wait_gone(pids) == [], "the demo or one of its workers outlived the launcher"
        text = log_path.read_text()
        assert "stopped after" in text, f"the demo did not stop at a step boundary:\n{text}"
    finally:
        _cleanup(launcher, pids)


def test_demo_runs_to_its_step_limit(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    proc = subprocess.run(
        [*CLI, "demo", "--no-tui", "--device", "cpu", "--steps", "3", "--log-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=subprocess_env,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "finished" in proc.stdout
    (log,) = tmp_path.glob("demo-balanced-*.log")
    assert "stopped after 3 steps" in log.read_text()


def test_unknown_scenario_is_one_clear_line(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    proc = subprocess.run(
        [*CLI, "demo", "--scenario", "no_such_thing", "--no-tui", "--log-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=subprocess_env,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "unknown demo scenario 'no_such_thing'" in proc.stderr
    assert "balanced" in proc.stderr  # it says what exists
    assert list(tmp_path.iterdir()) == []  # nothing was started


def test_cuda_without_cuda_shows_the_childs_reason(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    proc = subprocess.run(
        [*CLI, "demo", "--device", "cuda", "--log-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=subprocess_env,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "CUDA is not available" in proc.stderr
    assert "use --device cpu" in proc.stderr


def test_unwritable_log_dir_is_a_clear_error(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = subprocess.run(
        [*CLI, "demo", "--no-tui", "--log-dir", str(blocker / "logs")],
        capture_output=True,
        text=True,
        env=subprocess_env,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "cannot create the demo's log file" in proc.stderr
    assert "--log-dir" in proc.stderr


def test_scenarios_are_listed_without_importing_torch() -> None:
    code = "import sys, json; from torchtop.monitor.commands import demo; print(json.dumps([demo.scenarios(), 'torch' in sys.modules]))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    found, torch_loaded = json.loads(proc.stdout)
    assert "balanced" in found and "common" not in found and "data" not in found
    # every module listed is a script to run: none of the shared helpers
    demos_dir = Path(__file__).resolve().parent.parent / "demos"
    for name in found:
        assert "__main__" in (demos_dir / f"{demo.module_name(name)}.py").read_text(), name
    assert found["balanced"]  # a description from the module's docstring
    assert torch_loaded is False


def test_child_command_passes_the_limits() -> None:
    parser = __import__("argparse").ArgumentParser()
    demo.add_demo_arguments(parser)
    args = parser.parse_args(["--device", "cpu", "--steps", "7", "--seconds", "2.5", "--port", "41000"])
    cmd = demo.child_command(args)
    assert cmd[:3] == [sys.executable, "-m", "torchtop.demos.balanced"]
    assert cmd[3:] == ["--device", "cpu", "--steps", "7", "--seconds", "2.5", "--port", "41000"]


@pytest.mark.slow
def test_a_demo_starts_without_warnings_the_user_did_not_cause(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """torch without NumPy warns "Failed to initialize NumPy" at import; NumPy is no dependency
    and the demos use none, so that line must not open every demo. Other warnings still show."""
    plain = subprocess.run(
        [sys.executable, "-c", "import torch"],
        capture_output=True,
        text=True,
        env=subprocess_env,
        timeout=120,
    )
    if "Failed to initialize NumPy" not in plain.stderr:
        pytest.skip("this torch does not warn at import (NumPy is installed): nothing to keep out")
    demo_run = subprocess.run(
        [sys.executable, "-m", "torchtop.demos.balanced", "--device", "cpu", "--steps", "3"],
        capture_output=True,
        text=True,
        env=subprocess_env,
        cwd=tmp_path,
        timeout=180,
    )
    assert demo_run.returncode == 0, demo_run.stderr
    assert "Warning" not in demo_run.stderr and "NumPy" not in demo_run.stderr, demo_run.stderr
    warned = subprocess.run(  # the filter is that one message: a user's own warning still shows
        [
            sys.executable,
            "-c",
            "import torchtop.demos, torch, warnings; warnings.warn('mine', UserWarning)",
        ],
        capture_output=True,
        text=True,
        env=subprocess_env,
        timeout=120,
    )
    assert "UserWarning: mine" in warned.stderr and "NumPy" not in warned.stderr, warned.stderr
