"""The `?` screen: the keys (as this TUI binds them), and what the panels measure.

The key rows come from the app (bindings.help_rows over its enabled bindings), so the help never
names a tab or a quit behaviour that this TUI does not have.
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from torchtop.monitor.diagnosis.catalogue import HELP_FLAGS, HELP_VERDICTS

PANELS: tuple[tuple[str, str], ...] = (
    (
        "step time",
        "now / median / p90 of the training steps that ended in the last 10 s of the agent's "
        "clock, and steps per second",
    ),
    (
        "verdict",
        "what holds the step back, one of: "
        + ", ".join(HELP_VERDICTS)
        + "; with the numbers, where in your code, what a fix would buy and what to try. Flags: "
        + ", ".join(HELP_FLAGS),
    ),
    (
        "phases",
        "host time per step in data (dataloader wait), h2d (host-to-device copies), forward, "
        "backward, optimizer and other (the rest of the step), over the timed steps; device ms "
        "are CUDA-event times on event steps (1 step in k)",
    ),
    ("marks", 'values from torchtop.agent.mark("loss", loss)'),
    (
        "memory",
        "CUDA caching allocator: allocated / reserved / peak of the device, fragmentation (largest "
        "free block, external %)",
    ),
    (
        "GPU, host",
        "NVML per GPU; process and system CPU and memory, and each child process (DataLoader "
        "workers flagged)",
    ),
    (
        "status",
        "gaps: batches lost between agent and monitor; dropped: step records the agent's buffer dropped",
    ),
)


def _grid(rows: list[tuple[str, str]] | tuple[tuple[str, str], ...]) -> Table:
    """Two columns, the second wrapping under itself (never under the first) on a narrow screen."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(no_wrap=True, style="bold")
    grid.add_column(ratio=1)
    for key, words in rows:
        grid.add_row(key, words)
    return grid


def help_renderable(key_rows: list[tuple[str, str]]) -> RenderableType:
    return Group(
        Text("Keys", style="bold underline"),
        _grid(key_rows),
        Text(""),
        Text("Panels", style="bold underline"),
        _grid(PANELS),
    )


class HelpScreen(ModalScreen[None]):
    BINDINGS = [
        Binding("escape", "close", "Close"),
        Binding("question_mark", "close", "Close"),
    ]

    def __init__(self, key_rows: list[tuple[str, str]]) -> None:
        super().__init__()
        self.key_rows = key_rows

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-box"):
            yield Static(help_renderable(self.key_rows), id="help-text")

    def on_mount(self) -> None:
        self.query_one("#help-box").border_title = "torchtop help"

    def action_close(self) -> None:
        self.dismiss(None)

    def plain(self, width: int = 80) -> str:
        """The help as plain text at `width` columns (tests, screen readers)."""
        from io import StringIO

        from rich.console import Console

        console = Console(file=StringIO(), width=width, color_system=None)
        console.print(help_renderable(self.key_rows))
        return console.file.getvalue()  # type: ignore[attr-defined]
