"""User marks (torchtop.agent.mark("loss", loss)): per name the latest value and a sparkline.

The app sets `rows` (panel_data.mark_rows: up to 4 names, oldest value first); the panel is
hidden (class -empty) while the run records no marks.
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from torchtop.monitor.model import fmt
from torchtop.monitor.model.panel_data import MarkRow


def mark_lines(rows: list[MarkRow], width: int) -> list[Text]:
    name_w = min(16, max((len(r.name) for r in rows), default=4))
    lines = []
    for r in rows:
        text = Text(no_wrap=True, overflow="ellipsis")
        text.append(f"{r.name[:name_w]:<{name_w}}  ", style="dim")
        text.append(f"{fmt.number(r.latest):>10}", style="bold")
        lo, hi = min(r.series), max(r.series)
        tail = f"  {fmt.number(lo)} … {fmt.number(hi)}"
        spark_w = max(4, width - name_w - 14 - len(tail))
        text.append("  ")
        text.append(fmt.spark(r.series, spark_w), style="cyan")
        text.append(tail, style="dim")
        lines.append(text)
    return lines


class MarksPanel(Widget):
    rows: reactive[list[MarkRow]] = reactive(list, layout=True)

    def on_mount(self) -> None:
        self.border_title = "marks · torchtop.agent.mark()"
        self.set_class(not self.rows, "-empty")

    def watch_rows(self, rows: list[MarkRow]) -> None:
        self.set_class(not rows, "-empty")  # app.tcss hides an empty panel
        self.border_subtitle = f"last {max(len(r.series) for r in rows)} values" if rows else ""

    def render(self) -> RenderableType:
        return Group(*mark_lines(self.rows, max(30, self.content_size.width)))

    def plain(self, width: int = 100) -> str:
        return "\n".join(t.plain for t in mark_lines(self.rows, width))
