"""Issue 35 item 3: one judged window. The verdict, the breakdown, the hot spots and the report
read the same steps, chosen once (monitor/diagnosis/window.py): a window too short for the
verdict's 50 steps reaches back to them, and every figure then comes from those steps."""

from __future__ import annotations

import pytest

from torchtop.contract.wire import PROTOCOL_VERSION, Batch, Hello
from torchtop.monitor.diagnosis.diagnose import diagnose
from torchtop.monitor.diagnosis.report import run_report
from torchtop.monitor.diagnosis.window import choose
from torchtop.monitor.model.state import RunState
from torchtop.monitor.model.steps import StepRecord

MS = 1_000_000


def _state(early_data_ms: float) -> RunState:
    """60 steps of 300 ms; steps 10-24 wait `early_data_ms` for data, the last 35 do not: the
    last 10 s hold ~33 steps, fewer than the 50 a verdict judges."""
    t0 = 1_000.0
    state = RunState()
    state.apply_hello(
        Hello(
            v=PROTOCOL_VERSION, run_id="r", pid=1, host="h", port=1, pub_port=2, device="cpu", start_time=t0
        )
    )
    steps = []
    for i in range(60):
        data = early_data_ms if i < 25 else 0.0
        phases = {"data": int(data * MS), "forward": int((290 - data) * MS), "other": 10 * MS}
        steps.append(StepRecord(i, t0 + i * 0.3, 300 * MS, phases))
    state.apply_batch(Batch(v=PROTOCOL_VERSION, run_id="r", seq=0, time=t0 + 60 * 0.3 + 0.01), steps, 0.0)
    return state


def test_the_breakdown_and_the_verdict_read_the_same_steps() -> None:
    state = _state(early_data_ms=200.0)
    w = choose(state, 10.0)
    assert w.judged is not None and len(w.steps) == 50
    assert w.seconds == pytest.approx(15.0, abs=0.4)  # reaches back to the 50th-last step
    r = run_report(state, 10.0)
    # 15 of the 50 judged steps wait 200 of 300 ms: 20% data, in the report as in the verdict
    assert r.breakdown["data"] == pytest.approx(0.2, abs=0.01), r.breakdown
    assert r.covered_s == pytest.approx(w.seconds, abs=0.4)
    assert r.steps_in_full == r.steps == 50
    d = diagnose(state, window=w)
    assert d.steps == 50 and d.step_ms == pytest.approx(r.step_time_ms.mean)


def test_a_window_that_holds_enough_steps_is_the_one_asked() -> None:
    state = _state(early_data_ms=0.0)
    w = choose(state, 16.0)  # 53 steps: enough
    assert w.seconds == 16.0 and not w.line
    assert len(w.steps) == len([s for s in w.summary.in_full if s.i >= 10])
