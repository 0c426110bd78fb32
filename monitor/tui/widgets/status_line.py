"""The bottom status line: is the agent answering, and did anything get lost on the way.

Every counter that can explain a wrong-looking number is here: sequence gaps (batches lost
between agent and monitor), records the agent dropped, bad frames, hook errors, the last error.
One line at any width: an 80-column terminal keeps the counters that are not zero and the error's
start (its whole text is in the help).
"""

from __future__ import annotations

from collections.abc import Sequence

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
    width: int = 0,
) -> Text:
    """One line. Within `width` (0: any) the counters at zero go first, then the error is clipped
    at the edge: its full text is in the help (?)."""
    counters = (
        ("batches", batches),
        ("gaps", gaps),
        ("dropped", dropped),
        ("bad frames", bad_frames),
        ("hook errors", hook_errors),
    )
    text = _line(connection, counters, error, link, tunnel_down)
    if width and text.cell_len > width:
        text = _line(connection, [(k, v) for k, v in counters if v], error, link, tunnel_down)
    text.no_wrap, text.overflow = True, "ellipsis"
    if width:
        text.truncate(width, overflow="ellipsis")
    return text


def _line(
    connection: str, counters: Sequence[tuple[str, int]], error: str, link: Link, tunnel_down: bool
) -> Text:
    text = Text()
    style = "bold yellow" if tunnel_down else LINK_STYLES.get(link, "bold yellow")
    text.append(f"● {connection}", style=style)
    for label, value in counters:
        text.append(f"  {label} ", style="dim")
        text.append(fmt.count(value), style="bold red" if value and label != "batches" else "bold")
    if error:
        text.append("  last error ", style="dim")
        text.append(" ".join(error.split()), style="red")  # one line, whatever newlines it held
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
    error: reactive[str] = reactive("")  # clipped at the edge; the help (?) shows it whole

    def _text(self, width: int = 0) -> Text:
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
            width,
        )

    def render(self) -> RenderableType:
        return self._text(self.content_size.width)

    def plain(self) -> str:
        """The whole line, as if the terminal were wide enough."""
        return self._text().plain
