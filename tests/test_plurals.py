"""Issue 39 item 6: a count of one reads "1 step", not "1 steps" (fmt.plural), on every line
of the TUI and the report that can show one; and the line after Ctrl-C under `torchtop run`
says that a second one reaches the job."""

from __future__ import annotations

from typing import Any, cast

from torchtop.monitor.commands.run import stopping_line
from torchtop.monitor.diagnosis.facts import Diagnosis, Finding
from torchtop.monitor.diagnosis.warmup import Judged, notes
from torchtop.monitor.model import fmt
from torchtop.monitor.model.steps import StepRecord
from torchtop.monitor.tui.widgets.capture_line import capture_text
from torchtop.monitor.tui.widgets.step_panel import step_groups, step_title
from torchtop.monitor.tui.widgets.verdict_panel import verdict_title


def test_plural() -> None:
    assert [fmt.plural(n, "step") for n in (0, 1, 2)] == ["steps", "step", "steps"]
    assert fmt.plural(1, "pass", "passes") == "pass" and fmt.plural(3, "pass", "passes") == "passes"


def test_one_of_anything_is_singular() -> None:
    one = Diagnosis(Finding("compute", "ok", 0.9), steps=1, step_ms=5.0)
    assert verdict_title(one) == "verdict · 1 step judged · mean 5.00 ms a step"
    assert "2 steps judged" in verdict_title(Diagnosis(Finding("compute", "ok", 0.9), steps=2))
    # a job's verdict pools its ranks' steps: said a rank (3 x 157 read "471 steps judged")
    job = Diagnosis(Finding("straggler", "critical", 0.6), steps=471, step_ms=41.2, ranks=3)
    assert verdict_title(job) == "verdict · 157 steps × 3 ranks judged · mean 41.2 ms a step"
    passes = Diagnosis(Finding("compute", "ok", 0.9), steps=20, step_ms=495.0, inference=True)
    assert verdict_title(passes) == "verdict · 20 forward passes judged · mean 495 ms a pass"
    assert step_title(10.0, None, 1, 0).endswith("· 1 step (0 in full)")
    assert any(g.plain == "eval 1 pass" for g in step_groups({}, 0, None, evals=1))
    assert "profile 1 step " in capture_text(None, 1, 0).plain + " "
    judged = Judged([StepRecord(0, 0.0, 5_000_000, {"forward": 5_000_000}, "eval")], "eval", False)
    (line,) = notes(judged, cast(Any, None))
    assert ": 1 forward pass judged," in line, line


def test_the_first_ctrl_c_says_a_second_reaches_the_job() -> None:
    line = stopping_line(4242)
    assert "pid 4242" in line and "waiting for it to end" in line and "press Ctrl-C again" in line


def test_one_waiting_rank_waits() -> None:
    """ "the other 1 rank wait" (issue 39): the straggler's cost to a two-rank job."""
    from torchtop.monitor.diagnosis.straggler import Straggler, straggler_finding

    s = Straggler(1, "forward", 19.7, 6.5, 13.2, 44.0, 1, "warning")
    assert any(
        e.startswith("the other rank waits 13.2 ms a step for it") for e in straggler_finding(s).evidence
    )
    s = Straggler(1, "forward", 19.7, 6.5, 13.2, 44.0, 3, "warning")
    assert any(e.startswith("the other 3 ranks wait 13.2 ms") for e in straggler_finding(s).evidence)
