"""The `c` screen: past captures with their summaries and file paths (host and scp when remote).

The app sets `entries` (captures.capture_lines per capture, newest first) and `note` (the
capture in progress, or why the list is missing). The screen asks for a fresh list by posting
`CapturesScreen.RefreshWanted` on opening and on `r`.
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.message import Message
from textual.reactive import reactive
from textual.screen import Screen
from textual.widget import Widget
from textual.widgets import Static

from torchtop.monitor.tui.widgets.key_bar import KeyBar


def entry_text(lines: list[str]) -> Text:
    """A capture's first line bold and coloured by state, file and fetch lines highlighted."""
    text = Text()
    for k, line in enumerate(lines):
        if k:
            text.append("\n")
        if k == 0:
            style = "bold red" if ": failed" in line else "bold green" if ": done" in line else "bold"
        elif line.lstrip().startswith(("file:", "fetch:")):
            style = "bold cyan"
        else:
            style = ""
        text.append(line, style=style)
    return text


class CaptureList(Widget):
    entries: reactive[list[list[str]]] = reactive(list, layout=True)

    def render(self) -> RenderableType:
        if not self.entries:
            return Text(
                "no captures yet: press p (profile) or m (memory snapshot) on the dashboard", style="dim"
            )
        parts: list[RenderableType] = []
        for lines in self.entries:
            parts += [entry_text(lines), Text("")]
        return Group(*parts)

    def plain(self) -> str:
        return "\n\n".join("\n".join(lines) for lines in self.entries)


class CapturesScreen(Screen[None]):
    BINDINGS = [
        Binding("escape", "close", "Close"),
        Binding("c", "close", "Close"),
        Binding("r", "refresh_list", "Refresh"),
    ]

    class RefreshWanted(Message):
        """Ask the app for the agent's capture list (capture-status)."""

    entries: reactive[list[list[str]]] = reactive(list)
    note: reactive[str] = reactive("")

    def compose(self) -> ComposeResult:
        yield Static(self._note_text(), id="captures-note")
        with VerticalScroll(id="captures-box"):
            yield CaptureList(id="captures-list")
        yield KeyBar()  # one line: the job view's keys too would run past 80 columns

    def on_mount(self) -> None:
        self.query_one("#captures-box").border_title = "captures · newest first"
        self.query_one(CaptureList).entries = self.entries
        self.post_message(self.RefreshWanted())

    def _note_text(self) -> Text:
        return Text.assemble(
            ("Captures", "bold"), ("  r refresh · escape close   ", "dim"), (self.note, "bold magenta")
        )

    def watch_entries(self, entries: list[list[str]]) -> None:
        for widget in self.query(CaptureList):
            widget.entries = entries

    def watch_note(self) -> None:
        for widget in self.query("#captures-note").results(Static):
            widget.update(self._note_text())

    def action_refresh_list(self) -> None:
        self.post_message(self.RefreshWanted())

    def action_close(self) -> None:
        self.dismiss(None)
