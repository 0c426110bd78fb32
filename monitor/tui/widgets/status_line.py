"""The bottom status line: is the agent answering, and did anything get lost on the way.

Every counter that can explain a wrong-looking number is here: sequence gaps (batches lost
between agent and monitor), records the agent dropped, bad frames, hook errors, the last error.
"""

from __future__ import annotations

from rich.console import RenderableType
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from torchtop.monitor.model import fmt
from torchtop.monitor.model.state import Link

LINK_STYLES = {Link.CONNECTED: "bold green", Link.GONE: "bold red"}  # else yellow: waiting, stale


def status_text(
    connection: str,
    batches: int,
    gaps: int,
    dropped: int,
    bad_frames: int,
    hook_errors: int,
    error: str,
    link: Link = Link.WAITING,
    tunnel_down: bool = False,
) -> Text:
    text = Text()  # wraps: a long error takes a second line rather than being cut
    style = "bold yellow" if tunnel_down else LINK_STYLES.get(link, "bold yellow")
    text.append(f"● {connection}", style=style)
    for label, value in (
        ("batches", batches),
        ("gaps", gaps),
        ("dropped", dropped),
        ("bad frames", bad_frames),
        ("hook errors", hook_errors),
    ):
        text.append(f"  {label} ", style="dim")
        text.append(fmt.count(value), style="bold red" if value and label != "batches" else "bold")
    if error:
        text.append("  last error ", style="dim")
        text.append(error, style="red")
    return text


class StatusLine(Widget):
    connection: reactive[str] = reactive("waiting", layout=True)  # the link in words
    link: reactive[Link] = reactive(Link.WAITING)  # ... and as a state: its colour
    tunnel_down: reactive[bool] = reactive(False)
    batches: reactive[int] = reactive(0)
    gaps: reactive[int] = reactive(0)
    dropped: reactive[int] = reactive(0)
    bad_frames: reactive[int] = reactive(0)
    hook_errors: reactive[int] = reactive(0)
    error: reactive[str] = reactive("", layout=True)  # may take a second line

    def _text(self) -> Text:
        return status_text(
            self.connection,
            self.batches,
            self.gaps,
            self.dropped,
            self.bad_frames,
            self.hook_errors,
            self.error,
            self.link,
            self.tunnel_down,
        )

    def render(self) -> RenderableType:
        return self._text()

    def plain(self) -> str:
        return self._text().plain
