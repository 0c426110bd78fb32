"""One line above the status line: the capture in progress (with a progress bar), else the keys.

The app sets `capture` (the agent's current capture from the latest batch), `steps` (what `p`
will ask for) and `count` (captures known). Class -active while a capture runs (app.tcss).
"""

from __future__ import annotations

from rich.console import RenderableType
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from torchtop.contract.wire import CAPTURE_ACTIVE, CAPTURE_DEFAULT_STEPS, CaptureInfo, CaptureState
from torchtop.monitor.model import fmt
from torchtop.monitor.model.captures import progress, progress_text


def capture_text(capture: CaptureInfo | None, steps: int, count: int) -> Text:
    text = Text(no_wrap=True, overflow="ellipsis")
    if capture is not None and capture.state in CAPTURE_ACTIVE:
        text.append("◉ capturing ", style="bold magenta")
        text.append("▕", style="dim")
        text.append(fmt.bar(progress(capture), 20), style="magenta")
        text.append("▏ ", style="dim")
        text.append(progress_text(capture), style="bold")
        return text
    for key, words in (
        ("p", f"profile {steps} {fmt.plural(steps, 'step')}"),
        ("+/-", "steps"),
        ("m", "memory snapshot"),
        ("c", f"captures ({count})"),
    ):
        text.append(f"{key} ", style="bold")
        text.append(f"{words}   ", style="dim")
    if capture is not None:
        style = "red" if capture.state == CaptureState.FAILED else "green"
        text.append("last: ", style="dim")
        text.append(progress_text(capture), style=style)
    return text


class CaptureLine(Widget):
    capture: reactive[CaptureInfo | None] = reactive(None)
    steps: reactive[int] = reactive(CAPTURE_DEFAULT_STEPS)
    count: reactive[int] = reactive(0)

    def watch_capture(self, capture: CaptureInfo | None) -> None:
        self.set_class(capture is not None and capture.state in CAPTURE_ACTIVE, "-active")

    def render(self) -> RenderableType:
        return capture_text(self.capture, self.steps, self.count)

    def plain(self) -> str:
        return capture_text(self.capture, self.steps, self.count).plain
