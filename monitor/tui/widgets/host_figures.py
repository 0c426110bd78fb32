"""Host figures: the training process (CPU, RSS, threads), the machine's memory and each core.

The app sets `host` (wire.HostSample) or, when psutil is missing or off, `reason`. Colours: system
memory >= 80% / 90% used; each core's cell by its own load (>= 80% yellow, >= 95% red).
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from torchtop.contract.wire import HostSample
from torchtop.monitor.model import fmt
from torchtop.monitor.tui.widgets.meter import (
    LEVEL_STYLES,
    bar_width,
    meter,
    pairs,
    set_level_class,
    unavailable,
)


def core_row(per_core: list[float], width: int) -> Text:
    """One cell per core (cores averaged in groups when they do not fit), each 0-100% tall."""
    text = Text(no_wrap=True, overflow="crop")
    text.append(f"{'cores':<10}", style="dim")
    values = fmt.buckets(per_core, max(1, width))
    for v in values:
        text.append(fmt.spark([v], 1, 0.0, 100.0), style=LEVEL_STYLES[fmt.level(v / 100, 0.8, 0.95)])
    mean = sum(per_core) / len(per_core) if per_core else 0.0
    grouped = f", {len(per_core) // len(values)} a cell" if len(values) < len(per_core) else ""
    text.append(f"  {len(per_core)} cores{grouped} · mean {mean:.0f}%", style="dim")
    return text


def host_lines(h: HostSample, width: int) -> list[Text]:
    lines = [
        pairs(
            ("process CPU", f"{h.proc_cpu:.0f}% of a core"),
            ("RSS", fmt.size(h.proc_rss)),
            ("threads", fmt.count(h.threads)),
            ("children", fmt.count(len(h.workers))),
            width=width,
        )
    ]
    if h.mem_total:
        share = h.mem_percent / 100 if h.mem_percent else 1 - h.mem_available / h.mem_total
        used = h.mem_total - h.mem_available
        figures = f"{fmt.size(used)} used of {fmt.size(h.mem_total)} · {fmt.pct(share)}"
        lines.append(meter("memory", share, bar_width(width, [figures], most=30), figures, fmt.level(share)))
    if h.cpu_per_core:
        lines.append(core_row(h.cpu_per_core, min(len(h.cpu_per_core), max(8, width - 40))))
    return lines


class HostFigures(Widget):
    host: reactive[HostSample | None] = reactive(None, layout=True)
    reason: reactive[str] = reactive("", layout=True)

    def watch_host(self, host: HostSample | None) -> None:
        share = host.mem_percent / 100 if host is not None else 0.0
        for widget in (self, self.parent):  # the parent: the bordered box around figures and table
            if widget is not None:
                set_level_class(widget, fmt.level(share))

    def lines(self, width: int = 100) -> list[Text]:
        if self.host is None:
            return [unavailable("host figures", self.reason)]
        return host_lines(self.host, width)

    def render(self) -> RenderableType:
        return Group(*self.lines(max(40, self.content_size.width)))

    def plain(self, width: int = 100) -> str:
        return "\n".join(t.plain for t in self.lines(width))
