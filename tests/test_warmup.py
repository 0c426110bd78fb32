"""Issue 25: a verdict within ~30 s or 10 steps, its confidence said when the steps are few; the
warm-up line counts down; an inference loop judged on its forward passes; steps cut at each
backward said so (monitor/diagnosis/warmup.py)."""

from __future__ import annotations

from tests.agent_util import cpu_state
from torchtop.monitor.diagnosis.diagnose import diagnose
from torchtop.monitor.diagnosis.warmup import BACKWARD_NOTE
from torchtop.monitor.model.state import RunState
from torchtop.monitor.model.steps import StepKind, StepRecord

T0 = 1_000_000.0


def _steps(
    n: int, wall_s: float, kind: StepKind = "train", at_backward: bool = False, other: float = 0.05
) -> list[StepRecord]:
    out = []
    for i in range(n):
        ns = int(wall_s * 1e9)
        phases = {"forward": int(ns * (1 - other)), "other": ns - int(ns * (1 - other))}
        if kind == "eval":
            phases = {"data": 0, "forward": phases["forward"], "other": phases["other"]}
        out.append(StepRecord(i, T0 + i * wall_s, ns, phases, kind, at_backward=at_backward))
    return out


def _state(steps: list[StepRecord], now: float) -> RunState:
    return cpu_state(steps, now, T0 - 5)


def test_slow_steps_get_a_verdict_within_30_s_with_their_confidence() -> None:
    """13 s steps: two of them (26 s) give a verdict on the second, said to be of low confidence;
    before, 15 steps (over three minutes) were needed."""
    d = diagnose(_state(_steps(2, 13.0), T0 + 26.5))
    assert d.verdict.kind == "compute" and d.steps == 1, d.verdict
    assert any(e.startswith("confidence low: judged on 1 step of 13.0 s") for e in d.verdict.evidence), (
        d.verdict
    )
    # 3 s steps: 7 steps span 21 s; the first two are skipped, five judged
    d = diagnose(_state(_steps(7, 3.0), T0 + 21.5))
    assert d.verdict.kind == "compute" and d.steps == 5, d.verdict
    assert any(e.startswith("confidence moderate: judged on 5 steps") for e in d.verdict.evidence)
    # enough steps: no confidence line
    d = diagnose(_state(_steps(40, 0.1), T0 + 4.1))
    assert not any(e.startswith("confidence") for e in d.verdict.evidence), d.verdict


def test_the_warm_up_line_counts_down_with_steps_and_time() -> None:
    lines = []
    for n, now in ((1, 4.0), (1, 9.0), (2, 9.5), (3, 14.0)):
        d = diagnose(_state(_steps(n, 4.0), T0 + now))
        assert d.verdict.kind == "unknown"
        lines.append(d.verdict.evidence[0])
    assert len(set(lines)) == len(lines), lines  # each tick says something new
    assert "1 steps seen" in lines[0] and "after 9 more or in ~16 s" in lines[0], lines
    assert "in ~11 s" in lines[1] and "2 steps seen" in lines[2] and "in ~6 s" in lines[3], lines
    # past the time, a step still running: the verdict comes when it ends
    d = diagnose(_state(_steps(1, 15.0), T0 + 22.0))
    assert "when the one running now ends" in d.verdict.evidence[0], d.verdict


def test_no_step_at_all_says_why_and_what_to_call() -> None:
    d = diagnose(_state([], T0 + 30.0))
    line = d.verdict.evidence[0]
    assert d.verdict.kind == "unknown" and "no training step seen in 35 s" in line, line
    assert "optimizer.step()" in line and "torchtop.agent.step()" in line, line


def test_an_inference_loop_is_judged_on_its_forward_passes() -> None:
    steps = _steps(60, 0.02, kind="eval")
    steps[-1] = StepRecord(59, steps[-1].t0, int(0.2e9), steps[-1].phases, "eval")  # one slow pass
    d = diagnose(_state(steps, T0 + 1.5))
    assert d.verdict.kind == "compute", d.verdict
    line = next(e for e in d.verdict.evidence if e.startswith("inference only"))
    assert "latency p50 20.0 ms, p99 200.0 ms" in line, line


def test_steps_cut_at_backward_are_said_so() -> None:
    d = diagnose(_state(_steps(40, 0.1, at_backward=True), T0 + 4.1))
    assert BACKWARD_NOTE in d.verdict.evidence, d.verdict
    d = diagnose(_state(_steps(40, 0.1), T0 + 4.1))
    assert BACKWARD_NOTE not in d.verdict.evidence
