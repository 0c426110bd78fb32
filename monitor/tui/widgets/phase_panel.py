"""Phase breakdown panel: where each step's time goes, as a stacked bar and per-phase lines.

Shares come from `state.breakdown` (host time), ms from `state.phase_ms`, device ms from
`state.device_ms` (CUDA events on event steps; empty on CPU). Labels sit inside the bar
segments so the bar still reads without colour (TERM=dumb, NO_COLOR).
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from torchtop.contract.logcodes import PHASES
from torchtop.monitor.model import fmt

#: (background, text) per phase; the 16 standard colours, so 16-colour terminals match.
PHASE_COLOURS: dict[str, tuple[str, str]] = {
    "data": ("yellow", "black"),
    "h2d": ("magenta", "black"),
    "forward": ("cyan", "black"),
    "backward": ("blue", "white"),
    "optimizer": ("green", "black"),
    "comm": ("red", "white"),
    "checkpoint": ("bright_magenta", "black"),
    "other": ("bright_black", "white"),
}


def segment_widths(shares: dict[str, float], width: int) -> dict[str, int]:
    """Cells per phase, summing to `width` (largest remainder), 0 for phases with no time."""
    total = sum(max(0.0, shares.get(p, 0.0)) for p in PHASES)
    if total <= 0 or width <= 0:
        return dict.fromkeys(PHASES, 0)
    exact = {p: max(0.0, shares.get(p, 0.0)) / total * width for p in PHASES}
    cells = {p: int(v) for p, v in exact.items()}
    left = width - sum(cells.values())
    for p in sorted(PHASES, key=lambda p: exact[p] - cells[p], reverse=True)[:left]:
        cells[p] += 1
    return cells


def _label(name: str, share: float, cells: int) -> str:
    for label in (f"{name} {fmt.pct(share)}", name, name[:3], name[:1]):
        if len(label) + (2 if len(label) > 1 else 0) <= cells:
            return label
    return ""


def phase_bar(shares: dict[str, float], width: int) -> Text:
    """A stacked bar of `width` cells, one coloured segment per phase, labelled where it fits."""
    text = Text(no_wrap=True, overflow="crop")
    cells = segment_widths(shares, width)
    if not any(cells.values()):
        return Text("·" * max(0, width), style="dim")
    for name in PHASES:
        n = cells[name]
        if n <= 0:
            continue
        bg, fg = PHASE_COLOURS[name]
        text.append(_label(name, shares.get(name, 0.0), n).center(n), style=f"{fg} on {bg}")
    return text


def phase_table(
    shares: dict[str, float], ms: dict[str, float], device: dict[str, float], step_ms: float
) -> Table:
    """Per-phase ms per step and % of step time; a device column when CUDA timing exists."""
    table = Table(box=None, show_header=True, header_style="dim", pad_edge=False, padding=(0, 2, 0, 0))
    table.add_column("phase")
    table.add_column("ms/step", justify="right")
    table.add_column("% of step", justify="right")
    if device:
        table.add_column("device ms", justify="right")
    for name in PHASES:
        if name in ("comm", "checkpoint") and not ms.get(name) and not device.get(name):
            continue  # no collectives (one process), no saves: no row
        bg, _ = PHASE_COLOURS[name]
        row = [Text.assemble(("■ ", bg), name), fmt.ms(ms.get(name, 0.0)), fmt.pct(shares.get(name, 0.0))]
        if device:
            row.append(fmt.ms(device[name]) if name in device else "—")
        table.add_row(*row)
    total = [Text("  step", style="bold"), Text(fmt.ms(step_ms), style="bold"), Text("100.0%", style="bold")]
    if device:
        total.append(Text(fmt.ms(device["step"]) if "step" in device else "—", style="bold"))
    table.add_row(*total)
    return table


class PhasePanel(Widget):
    """Host-time breakdown of the steps in the recent window."""

    shares: reactive[dict[str, float]] = reactive(dict)
    ms: reactive[dict[str, float]] = reactive(dict)
    device: reactive[dict[str, float]] = reactive(dict)
    step_ms: reactive[float] = reactive(0.0)
    event_every: reactive[int] = reactive(0)
    count: reactive[int] = reactive(0)
    timed: reactive[int] = reactive(0)  # steps whose phases were timed (a sample of fast steps)

    def on_mount(self) -> None:
        self._title()

    def _title(self) -> None:
        sampled = 0 < self.timed < self.count
        self.border_title = "phases · host time per step" + (
            f" · timed on {self.timed} of {self.count} {fmt.plural(self.count, 'step')}" if sampled else ""
        )

    def watch_timed(self) -> None:
        self._title()

    def watch_count(self, old: int, new: int) -> None:
        self._title()
        if (old == 0) != (new == 0):
            self.refresh(layout=True)  # one placeholder line <-> bar and table

    def watch_event_every(self, every: int) -> None:
        self.border_subtitle = f"device: CUDA events, 1 step in {every}" if every else ""

    def render(self) -> RenderableType:
        if not self.count:
            return Text("no training steps in the window yet", style="dim")
        width = max(10, self.content_size.width)
        return Group(
            phase_bar(self.shares, width),
            Text(""),
            phase_table(self.shares, self.ms, self.device, self.step_ms),
        )

    def share_of(self, phase: str) -> str:
        """A phase's share as shown, e.g. '40.0%'."""
        return fmt.pct(self.shares.get(phase, 0.0))
