"""Issue 25 on screen: the verdict panel says that steps are counted at each backward (no
optimizer.step() seen), and with no step at all, why and what to call."""

from __future__ import annotations

from msgspec import structs

from tests.test_tui_panels import app_without_feed, fed, fed_batches, hello
from tests.tui_util import HOST, steps
from torchtop.contract import wire
from torchtop.monitor.diagnosis.warmup import BACKWARD_NOTE
from torchtop.monitor.tui.feed import HelloReceived
from torchtop.monitor.tui.widgets import VerdictPanel


async def test_the_verdict_panel_says_steps_end_at_each_backward() -> None:
    app = app_without_feed()
    async with app.run_test(size=(120, 40)) as pilot:
        panel = app.query_one(VerdictPanel)
        await fed(pilot, HelloReceived(hello(device="cpu")))
        text = " ".join(panel.plain().split())
        assert "Warming up" in text and "no training step seen" in text, text
        assert "torchtop.agent.step()" in text, text
        manual = [structs.replace(s, at_backward=True) for s in steps(60, data=0.02)]
        await fed(pilot, fed_batches(manual, wire.Telemetry(time=0, host=HOST)))
        text = " ".join(panel.plain().split())
        assert BACKWARD_NOTE in text, text
