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
def test_the_monitor_attaches_by_pid_and_receives_every_step(port: int | None) -> None:
    agent = ta.start(port=port)
    assert agent is not None
    _steps(5)
    monitor = Monitor(os.getpid()).start()
    try:
        before = agent.probe.steps
        _steps(60)
        got = monitor.finish(agent.probe.steps - before)
    finally:
        monitor.kill()
    assert got.transport == ("ipc" if port is None else "tcp")
    assert got.steps >= 60 and got.batches > 0 and got.bad_frames == 0


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
