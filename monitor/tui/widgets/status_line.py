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


def _connection_style(connection: str) -> str:
    if connection.startswith("connected"):
        return "bold green"
    if connection.startswith("agent gone"):
        return "bold red"
    return "bold yellow"  # waiting, stale, a tunnel being rebuilt


def status_text(
    connection: str, batches: int, gaps: int, dropped: int, bad_frames: int, hook_errors: int, error: str
) -> Text:
    text = Text()  # wraps: a long error takes a second line rather than being cut
    text.append(f"● {connection}", style=_connection_style(connection))
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
    connection: reactive[str] = reactive("waiting", layout=True)
    batches: reactive[int] = reactive(0)
    gaps: reactive[int] = reactive(0)
    dropped: reactive[int] = reactive(0)
    bad_frames: reactive[int] = reactive(0)
    hook_errors: reactive[int] = reactive(0)
    error: reactive[str] = reactive("", layout=True)  # may take a second line

    def render(self) -> RenderableType:
        return status_text(
            self.connection,
            self.batches,
            self.gaps,
            self.dropped,
            self.bad_frames,
            self.hook_errors,
            self.error,
        )

    def plain(self) -> str:
        return status_text(
            self.connection,
            self.batches,
            self.gaps,
            self.dropped,
            self.bad_frames,
            self.hook_errors,
            self.error,
        ).plain
