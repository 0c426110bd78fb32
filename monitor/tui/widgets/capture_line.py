"""One line above the status line: the capture in progress (with a progress bar), else the keys.

The app sets `capture` (the agent's current capture from the latest batch), `steps` (what `p`
will ask for) and `count` (captures known). Class -active while a capture runs (app.tcss).
"""

from __future__ import annotations

from rich.console import RenderableType
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from torchtop.contract.wire import (
    CAPTURE_ACTIVE,
    CAPTURE_DEFAULT_STEPS,
    CaptureInfo,
    CaptureKind,
    CaptureState,
)
from torchtop.monitor.model import fmt
from torchtop.monitor.model.captures import progress, progress_text, toast_text


def capture_text(capture: CaptureInfo | None, steps: int, count: int, width: int = 0) -> Text:
    """The line; with a `width` too narrow for the keys and the last capture, the keys in short
    words (the help has them whole), so the last capture's state is not cut off."""
    full = _capture_text(capture, steps, count, False)
    if not width or full.cell_len <= width or capture is None:
        return full
    return _capture_text(capture, steps, count, True)


def _capture_text(capture: CaptureInfo | None, steps: int, count: int, short: bool) -> Text:
    text = Text(no_wrap=True, overflow="ellipsis")
    if capture is not None and capture.state in CAPTURE_ACTIVE:
        text.append("◉ capturing ", style="bold magenta")
        text.append("▕", style="dim")
        text.append(fmt.bar(progress(capture), 20), style="magenta")
        text.append("▏ ", style="dim")
        text.append(progress_text(capture), style="bold")
        return text
    keys = (
        (("p", f"profile {steps}"), ("m", "memory"), ("c", f"({count})"))
        if short
        else (
            ("p", f"profile {steps} {fmt.plural(steps, 'step')}"),
            ("+/-", "steps"),
            ("m", "memory snapshot"),
            ("c", f"captures ({count})"),
        )
    )
    for key, words in keys:
        text.append(f"{key} ", style="bold")
        text.append(f"{words}  " if short else f"{words}   ", style="dim")
    if capture is not None:
        style = "red" if capture.state == CaptureState.FAILED else "green"
        text.append("last: ", style="dim")
        if short and capture.state == CaptureState.DONE:  # its file on the Captures screen
            what = "profile" if capture.kind == CaptureKind.PROFILE else "memory snapshot"
            text.append(f"{what} #{capture.id} done (c: its file)", style=style)
        else:
            text.append(toast_text(capture) if short else progress_text(capture), style=style)
    return text


class CaptureLine(Widget):
    capture: reactive[CaptureInfo | None] = reactive(None)
    steps: reactive[int] = reactive(CAPTURE_DEFAULT_STEPS)
    count: reactive[int] = reactive(0)

    def watch_capture(self, capture: CaptureInfo | None) -> None:
        self.set_class(capture is not None and capture.state in CAPTURE_ACTIVE, "-active")

    def render(self) -> RenderableType:
        return capture_text(self.capture, self.steps, self.count, self.size.width)

    def plain(self) -> str:
        return capture_text(self.capture, self.steps, self.count).plain
