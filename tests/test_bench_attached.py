"""The benchmarks' attached monitor (tests/benchmarks/attached.py) attaches as the TUI does, on
ipc and TCP, and a run whose monitor received less than the agent cut fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import torchtop.agent as ta  # noqa: E402
from torchtop.agent.telemetry.host import child_pids  # noqa: E402

BENCH = Path(__file__).parent / "benchmarks"
sys.path.insert(0, str(BENCH))
from attached import Monitor  # noqa: E402


def _steps(n: int) -> None:
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(n):
        loss = model(torch.randn(4, 8)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize("port", [None, 0], ids=["ipc", "tcp"])
@pytest.mark.slow  # among the fast subset's slowest, ~5.1 s here (issue 27: the subset under 60 s)
def test_the_monitor_attaches_by_pid_and_receives_every_step(port: int | None) -> None:
    agent = ta.start(port=port)
    assert agent is not None
    _steps(5)
    monitor = Monitor(os.getpid()).start()
    # not our child, as a real monitor is not: a child is sampled every second as a worker
    assert monitor.subscriber > 0 and monitor.subscriber not in (child_pids(os.getpid()) or [])
    try:
        before = agent.probe.steps
        _steps(60)
        got = monitor.finish(agent.probe.steps - before)
    finally:
        monitor.kill()
    assert got.transport == ("ipc" if port is None else "tcp")
    assert got.steps >= 60 and got.batches > 0 and got.bad_frames == 0


@pytest.mark.slow  # among the fast subset's slowest, ~2.6 s here (issue 27: the subset under 60 s)
def test_a_monitor_that_received_less_than_the_agent_cut_fails_the_run() -> None:
    agent = ta.start()
    assert agent is not None
    monitor = Monitor(os.getpid()).start()
    _steps(10)
    with pytest.raises(SystemExit, match="unwatched agent"):
        monitor.finish(10_000)


def test_a_monitor_that_finds_no_agent_fails_at_once(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="did not attach"):
        Monitor(os.getpid()).start(timeout=30)  # no agent runs in this process


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_bench_paired_attached_reports_what_its_monitor_received(transport: str) -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH / "bench_paired.py"), "--size", "32", "--pairs", "20", "--attached"]
        + ["--transport", transport, "--warm-steps", "20", "--free-steps", "40"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"monitor attached by pid over {transport}: received" in out.stdout
    assert "0 batches missed" in out.stdout


def test_watched_ticks_slow_down_to_keep_their_cpu_under_the_share() -> None:
    """A tick's CPU mostly holds the GIL training needs: while watched, the agent ticks at
    RATE_HZ if that costs under TICK_SHARE of the time, slower (SLOWEST_RATE_HZ at the slowest)
    if not; unwatched, at QUIET_RATE_HZ."""
    from types import SimpleNamespace

    from torchtop.agent.loop.loop import QUIET_RATE_HZ, RATE_HZ, SLOWEST_RATE_HZ, TICK_SHARE, AgentLoop

    def period(watched: bool, tick_s: float, subscribed: bool | None = None) -> float:
        loop = SimpleNamespace(
            period=1 / RATE_HZ,
            subscribed=watched if subscribed is None else subscribed,
            watched=watched,
            tick_ns=tick_s * 1e9,
        )
        return AgentLoop.tick_period(loop)  # type: ignore[arg-type]

    assert period(True, 0.0) == pytest.approx(1 / RATE_HZ)
    cheap = TICK_SHARE / RATE_HZ / 2  # a tick this cheap costs half the share at RATE_HZ
    assert period(True, cheap) == pytest.approx(1 / RATE_HZ)
    assert period(True, 4 * cheap) == pytest.approx(4 * cheap / TICK_SHARE)  # 5 Hz: the share kept
    assert period(True, 0.01) == pytest.approx(1 / SLOWEST_RATE_HZ)  # dear ticks: 1 Hz at the slowest
    assert period(True, 0.3 * TICK_SHARE) == pytest.approx(0.3)  # between: the share kept
    assert period(False, 0.0) == pytest.approx(1 / QUIET_RATE_HZ)
    # a node's relay alone on the stream (not watching: wire.WATCH_TOPIC): the quiet rate
    assert period(False, 0.0, subscribed=True) == pytest.approx(1 / QUIET_RATE_HZ)
