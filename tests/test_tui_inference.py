"""Issue 39 item 2: an eval or serving loop (forward passes, no training step) gets its own step
panel (latency now / p50 / p90 / p99, passes/s) and a verdict that speaks of passes, not of
"forward+backward+optimizer"; a training run keeps its step-time panel."""

from __future__ import annotations

from tests.test_tui import T0, app_without_feed, batch, fed_app, hello
from torchtop.monitor.model.steps import StepRecord
from torchtop.monitor.tui.feed import BatchesReceived, HelloReceived
from torchtop.monitor.tui.widgets import StepPanel, VerdictPanel

MS = 1_000_000


def _passes(n: int = 60) -> list[StepRecord]:
    """`n` forward passes of 20 ms, every tenth of 60 ms: p50 20, p99 60."""
    out, t = [], T0
    for i in range(n):
        wall = (60 if i % 10 == 9 else 20) * MS
        out.append(StepRecord(i, t, wall, {"forward": wall - MS, "other": MS}, kind="eval"))
        t += wall / 1e9
    return out


async def test_an_eval_loop_shows_its_latency_and_a_verdict_of_passes() -> None:
    app = app_without_feed()
    async with app.run_test(size=(120, 40)) as pilot:
        await fed_app(pilot, HelloReceived(hello()), BatchesReceived([batch(_passes())]))
        panel = app.query_one(StepPanel)
        text = panel.numbers_text()
        assert panel.border_title.startswith("forward latency · last"), panel.border_title
        assert "p50 20.0 ms" in text and "p99 60.0 ms" in text and "passes/s" in text, text
        assert "no training steps" not in text
        d = app.query_one(VerdictPanel).diagnosis
        assert d is not None and d.verdict.kind != "unknown"
        assert not any("forward+backward+optimizer" in e for e in d.verdict.evidence), d.verdict.evidence
        assert any(e.startswith("inference only") for e in d.verdict.evidence), d.verdict.evidence
        # its title counts passes, and its advice is not a training run's
        assert app.query_one(VerdictPanel).border_title.startswith("verdict · "), app.query_one(
            VerdictPanel
        ).border_title
        assert "forward passes judged" in str(app.query_one(VerdictPanel).border_title)
        assert not any("train" in a or "optimizer" in a for a in d.verdict.advice), d.verdict.advice
