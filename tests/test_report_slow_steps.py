"""Issue 35 item 5: `report --seconds S` on steps longer than S judges the steps the agent kept
and says its window widened; "no training step seen" only when none was.

Real CPU scripts in child processes: one whose steps take ~3 s, one that never steps."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchtop.contract import discovery
from torchtop.contract.wire import PROTOCOL_VERSION, Batch, Hello
from torchtop.monitor.commands import cli
from torchtop.monitor.diagnosis.report import run_report
from torchtop.monitor.link.client import AgentClient
from torchtop.monitor.link.targets import from_discovery
from torchtop.monitor.model.state import RunState
from torchtop.monitor.model.steps import StepRecord

SLOW = r"""
import pathlib, sys, time, torch
import torchtop.agent

torch.set_num_threads(1)
torchtop.agent.start()
out = pathlib.Path(sys.argv[1])


class Slow(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 1)

    def forward(self, x):
        time.sleep(3.0)  # a step of seconds, as a large model's on a slow device
        return self.lin(x)


model = Slow()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x, y = torch.randn(4, 8), torch.randn(4, 1)
for i in range(1000):
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    out.write_text(str(i + 1))
"""

IDLE = r"""
import time, torch
import torchtop.agent

torchtop.agent.start()
time.sleep(600)  # never a step
"""


def _start(tmp_path: Path, env: dict[str, str], source: str, *args: str) -> subprocess.Popen[bytes]:
    script = tmp_path / "train.py"
    script.write_text(source)
    log = (tmp_path / "train.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, str(script), *args], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + 60
    while not any(a.pid == proc.pid for a in discovery.list_agents()):
        assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "train.log").read_text()
        time.sleep(0.05)
    return proc


def _report(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    capsys.readouterr()
    assert cli.main(["report", *args]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_a_report_shorter_than_a_step_judges_the_steps_it_can_see(
    tmp_path: Path, subprocess_env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch")
    done = tmp_path / "steps"
    proc = _start(tmp_path, subprocess_env, SLOW, str(done))
    try:
        deadline = time.monotonic() + 240
        # a monitor already watches (the TUI open beside it): the report's subscription then gets
        # no catch-up of the agent's recent log, only what ends in its own second
        info = next(a for a in discovery.list_agents() if a.pid == proc.pid)
        watcher = AgentClient(from_discovery(info))
        while not (done.exists() and done.read_text() and int(done.read_text()) >= 8):
            assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "train.log").read_text()
            time.sleep(0.5)  # eight steps of ~3 s: past the early verdict's 20 s
        r = _report(capsys, str(proc.pid), "--seconds", "1")
        watcher.close()
    finally:
        proc.kill()
        proc.wait()
    verdict = r["verdict"]
    assert verdict["kind"] != "unknown", verdict
    line = next((e for e in verdict["evidence"] if "widened" in e), None)
    assert line is not None and line.startswith("judged on "), verdict
    assert not r["history"] and r["seconds"] == 1.0
    assert r["steps"] >= 2 and r["covered_s"] > 2 * r["seconds"], r  # the figures are of those steps


@pytest.mark.slow
def test_a_report_of_a_run_that_never_steps_says_no_step_was_seen(
    tmp_path: Path, subprocess_env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch")
    proc = _start(tmp_path, subprocess_env, IDLE)
    try:
        r = _report(capsys, str(proc.pid), "--seconds", "1")
    finally:
        proc.kill()
        proc.wait()
    verdict = r["verdict"]
    assert verdict["kind"] == "unknown" and "no training step seen" in verdict["evidence"][0], verdict
    assert not any("widened" in e for e in verdict["evidence"]), verdict


def _state(n: int, wall_s: float) -> RunState:
    t0 = 1_000_000.0
    state = RunState()
    state.apply_hello(
        Hello(
            v=PROTOCOL_VERSION, run_id="r", pid=1, host="h", port=1, pub_port=2, device="cpu", start_time=t0
        )
    )
    ns = int(wall_s * 1e9)
    steps = [StepRecord(i, t0 + i * wall_s, ns, {"forward": ns}) for i in range(n)]
    state.apply_batch(Batch(v=PROTOCOL_VERSION, run_id="r", seq=0, time=t0 + n * wall_s + 0.5), steps, 0.0)
    return state


def test_the_widened_window_is_said_and_its_figures_are_of_the_judged_steps() -> None:
    state = _state(4, 11.0)  # 11 s steps, a 10 s report: one step ended in it
    r = run_report(state, 10.0, widen=True)
    line = next(e for e in r.verdict.evidence if "widened" in e)
    assert line.startswith("judged on 3 steps of 11.0 s") and "10 s asked" in line, line
    assert r.steps == 3 and r.covered_s == pytest.approx(33.0) and not r.history
    # not asked to widen (the exporter's windows): the window holds what it holds
    assert not any("widened" in e for e in run_report(state, 10.0).verdict.evidence)
    # steps shorter than the window: nothing widened
    fast = _state(40, 0.5)
    assert not any("widened" in e for e in run_report(fast, 10.0, widen=True).verdict.evidence)


def test_a_job_report_on_steps_longer_than_its_window_judges_the_ranks_kept_steps() -> None:
    """The job path too: 11 s steps, a 10 s report: the job verdict is of the ranks' kept steps,
    says its window widened, and the job's figures are of the same steps ("no training step seen"
    only when none was)."""
    from tests.rank_util import feed, rank_steps
    from torchtop.monitor.diagnosis.job_diagnosis import build_job_report
    from torchtop.monitor.model.job_state import JobState

    job = JobState()
    feed(job, {r: rank_steps(r, n=4, step_ms=11_000.0, forward=6_000.0, backward=4_000.0) for r in range(2)})
    r = build_job_report(job, 10.0, "test")
    evidence = r["verdict"]["evidence"]
    assert r["verdict"]["kind"] != "unknown" and not any("no training step seen" in e for e in evidence), (
        evidence
    )
    line = next((e for e in evidence if "widened" in e), None)
    assert line is not None and "of 11.0 s" in line and "10 s asked" in line, evidence
    assert r["job"]["covered_s"] > 20.0, r["job"]  # the figures reach back to the judged steps
