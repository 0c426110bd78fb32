"""Coloured meters and "not available" lines shared by the memory, GPU and host panels."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.text import Text

from torchtop.monitor.model import fmt
from torchtop.monitor.model.fmt import Level

if TYPE_CHECKING:
    from textual.dom import DOMNode

#: Rich style per threshold level (fmt.level); the 16 standard colours.
LEVEL_STYLES: dict[Level, str] = {"ok": "green", "warning": "yellow", "critical": "red"}
LEVEL_CLASSES = ("-ok", "-warning", "-critical")


def meter(
    label: str, fraction: float, width: int, figures: str, level: Level = "ok", label_width: int = 10
) -> Text:
    """`label ▕████▌    ▏ figures`: the bar coloured by `level`, the figures after it."""
    text = Text(no_wrap=True, overflow="ellipsis")
    text.append(f"{label:<{label_width}}", style="dim")
    text.append("▕", style="dim")
    text.append(fmt.bar(fraction, width), style=LEVEL_STYLES.get(level, "green"))
    text.append("▏ ", style="dim")
    text.append(figures, style=f"bold {LEVEL_STYLES[level]}" if level != "ok" else "bold")
    return text


def bar_width(width: int, figures: list[str], most: int = 40, label_width: int = 10) -> int:
    """Cells for the bars of meters that share a panel: what the longest figures leave of
    `width` (the label, the bar's ends and a space take label_width + 3), between 8 and `most`."""
    longest = max((len(f) for f in figures), default=0)
    return max(8, min(most, width - label_width - 3 - longest))


def unavailable(what: str, reason: str) -> Text:
    """The one line a panel shows when its figures do not exist on this run, and why."""
    return Text.assemble((f"{what} not available: ", "dim"), (reason or "no data received yet", "bold"))


def pairs(*items: tuple[str, str] | tuple[str, str, str], width: int = 0) -> Text:
    """`label value  label value …`: labels dim, values bold (or in the given style). With a
    `width`, a pair that would cross it starts a new line: a label never parts from its value."""
    text = Text()
    line = 0
    for k, item in enumerate(items):
        label, value = item[0], item[1]
        style = item[2] if len(item) > 2 else "bold"  # type: ignore[misc]
        cells = len(f"{label} {value}" if label else value)
        if k and width and line + 2 + cells > width:
            text.append("\n")
            line = 0
        elif k:
            text.append("  ")
            line += 2
        if label:
            text.append(f"{label} ", style="dim")
        text.append(value, style=style)
        line += cells
    return text


def set_level_class(widget: DOMNode, level: Level) -> None:
    """Put exactly one of -ok / -warning / -critical on `widget` (border colour in app.tcss)."""
    for cls in LEVEL_CLASSES:
        widget.set_class(cls == f"-{level}", cls)
