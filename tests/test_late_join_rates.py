"""A late join at ordinary and slow step rates (issue 26, item 10): `report PID --history` taken
mid-run holds every step that had ended, with `covered_s` the time from the run's first step and
`gaps` 0. The issue's losses (582 of ~746 steps at 32 steps/s; a 12 s window covering 6.9 s at
~108 ms steps) were measured on an H100 and do not reproduce on CPU: the CPU cases guard what
holds here, the CUDA cases (`-m cuda`) are the issue's, for a GPU machine."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchtop.contract import discovery

pytest.importorskip("torch")
pytestmark = pytest.mark.slow

TRAIN = r"""
import pathlib, sys, time, torch
import torchtop.agent
torch.set_num_threads(1)
torchtop.agent.start()
step_s, device, done = float(sys.argv[1]), sys.argv[2], pathlib.Path(sys.argv[3])
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=1e-4)
x, y = torch.randn(64, 256, device=device), torch.randn(64, 1, device=device)
start, k = time.time(), 0
while time.time() - start < 60:
    t = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    k += 1
    done.write_text(f"{k} {start}")  # steps ended, and when the first began
    time.sleep(max(0.0, step_s - (time.perf_counter() - t)))
"""


def _read(done: Path) -> tuple[int, float] | None:
    """(steps ended, when the first began) from the trainer's file; None while it is rewritten."""
    try:
        ended, start = done.read_text().split()
        return int(ended), float(start)
    except (OSError, ValueError):
        return None


def _late_report(tmp_path: Path, env: dict[str, str], step_s: float, device: str, join_s: float) -> None:
    script, done = tmp_path / "train_rate.py", tmp_path / "done"
    script.write_text(TRAIN)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(step_s), device, str(done)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while (got := _read(done)) is None or time.time() - got[1] < join_s:
            assert proc.poll() is None and time.monotonic() < deadline, "the training did not start"
            time.sleep(0.1)
        assert any(a.pid == proc.pid for a in discovery.list_agents())
        while (before := _read(done)) is None:
            time.sleep(0.001)
        joined = time.time()
        out = subprocess.run(
            [sys.executable, "-m", "torchtop.monitor.commands.cli", "report", str(proc.pid), "--history",
             "--seconds", "2"],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        stopped = time.time()
        while (got := _read(done)) is None:
            time.sleep(0.001)
    finally:
        proc.kill()
        proc.wait()
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    truth, elapsed = got[0], stopped - got[1]
    print(f"\nlate join at {1 / step_s:.0f} steps/s after {join_s:g} s: {report['steps']} steps of {truth} "
          f"({before[0]} at the join), covered {report['covered_s']:.1f} s of {elapsed:.1f} s, "
          f"gaps {report['gaps']}")  # fmt: skip
    # every step that had ended when the report started, and none that had not when it returned:
    # how many end meanwhile is the machine's (a loaded one took over a second to exit)
    assert before[0] <= report["steps"] <= truth
    # from the run's first step to at least the last step ended at the join (it ended within a
    # step's time of it)
    assert joined - before[1] - step_s - 0.5 <= report["covered_s"] <= elapsed
    assert report["gaps"] == 0


@pytest.mark.parametrize("step_s", [1 / 32, 0.108])
def test_a_late_join_holds_every_step_on_cpu(
    tmp_path: Path, subprocess_env: dict[str, str], step_s: float
) -> None:
    _late_report(tmp_path, subprocess_env, step_s, "cpu", join_s=12.0)


@pytest.mark.cuda
@pytest.mark.parametrize("step_s", [1 / 32, 0.108])
def test_a_late_join_holds_every_step_on_cuda(
    tmp_path: Path, subprocess_env: dict[str, str], step_s: float
) -> None:
    _late_report(tmp_path, subprocess_env, step_s, "cuda", join_s=20.0)
