"""Memory figures: allocated / reserved / peak against the device, fragmentation, retries, OOMs.

The app sets the latest `memory` and `frag` samples (contract/wire.py), the highest window peak
seen per device and the retry rate; without CUDA it sets `reason` (the agent's word for why,
e.g. "CUDA not in use") and the panel shows only that. Threshold colours: a share of the device
>= 80% yellow, >= 90% red (the diagnosis warns at 90%); any retry or OOM red.
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from torchtop.contract.wire import FragSample, MemorySample
from torchtop.monitor.diagnosis.facts import THRESHOLDS
from torchtop.monitor.model import fmt
from torchtop.monitor.model.panel_data import memory_level
from torchtop.monitor.tui.widgets.meter import bar_width, meter, pairs, set_level_class, unavailable

WARN, CRIT = 0.8, 0.9


def _share(n: int, total: int) -> float:
    return n / total if total > 0 else 0.0


def device_lines(
    m: MemorySample, frag: FragSample | None, window_peak: int, retry_rate: float, width: int
) -> list[Text]:
    """One device: three meters, then the allocator's other figures."""
    total = m.device_total
    of = f" of {fmt.size(total)}" if total else ""
    if total and m.limit_fraction < 1.0:  # set_per_process_memory_fraction: the cap, not the device
        of += f" (capped at {fmt.pct(m.limit_fraction)} of the device)"
    rows = []
    for label, value, extra in (
        ("allocated", m.allocated, of),
        ("reserved", m.reserved, ""),
        ("peak", m.peak_allocated, f" since start · window peak {fmt.size(window_peak)}"),
    ):
        share = _share(value, total)
        figures = f"{fmt.size(value)} · {fmt.pct(share)}{extra}" if total else f"{fmt.size(value)}{extra}"
        rows.append((label, share, figures))
    bar_w = bar_width(width, [f for _, _, f in rows])
    lines = [meter(label, share, bar_w, f, fmt.level(share, WARN, CRIT)) for label, share, f in rows]
    lines.append(
        pairs(
            ("active", fmt.size(m.active)),
            ("requested", fmt.size(m.requested)),
            ("rounding waste", fmt.size(max(0, m.allocated - m.requested))),
            width=width,
        )
    )
    if frag is not None:
        ext_style = "bold yellow" if frag.external >= THRESHOLDS.frag_external and frag.total_free else "bold"
        lines.append(
            pairs(
                ("largest free", fmt.size(frag.largest_free)),
                ("free in segments", fmt.size(frag.total_free)),
                ("external fragmentation", fmt.pct(frag.external), ext_style),
                width=width,
            )
        )
        lines.append(
            pairs(
                ("segments", fmt.count(frag.segments)),
                ("expandable", "on" if frag.expandable else "off"),
                ("inactive split", fmt.size(m.inactive_split)),
                width=width,
            )
        )
    else:
        lines.append(
            pairs(
                ("inactive split", fmt.size(m.inactive_split)),
                ("fragmentation", "not sampled yet", "dim"),
                width=width,
            )
        )
    retries = "bold red" if retry_rate > 0 else ("bold yellow" if m.alloc_retries else "bold")
    lines.append(
        pairs(
            ("alloc retries", f"{fmt.count(m.alloc_retries)} ({retry_rate:.2f}/s)", retries),
            ("OOMs", fmt.count(m.ooms), "bold red" if m.ooms else "bold"),
            width=width,
        )
    )
    return lines


class MemoryFigures(Widget):
    """The CUDA caching allocator's figures for each device of the process."""

    memory: reactive[list[MemorySample]] = reactive(list, layout=True)
    frag: reactive[list[FragSample]] = reactive(list)
    peak_window: reactive[dict[int, int]] = reactive(dict)
    retry_rate: reactive[float] = reactive(0.0)
    reason: reactive[str] = reactive("", layout=True)
    forecast: reactive[str] = reactive("", layout=True)  # time to the memory limit (diagnosis/oom.py)

    def watch_memory(self) -> None:
        self._level()

    def watch_retry_rate(self) -> None:
        self._level()

    def _level(self) -> None:
        shares = [
            max(_share(m.reserved, m.device_total), _share(self.peak_window.get(m.device, 0), m.device_total))
            for m in self.memory
        ]
        level = memory_level(shares, self.retry_rate, sum(m.ooms for m in self.memory), WARN, CRIT)
        set_level_class(self, level)
        if self.parent is not None:
            set_level_class(self.parent, level)  # the bordered box around figures and plot

    def lines(self, width: int = 100) -> list[Text]:
        # on CPU the forecast is of the RSS: said under the missing CUDA figures
        oom = [Text(f"OOM forecast: {self.forecast}", style="bold")] if self.forecast else []
        if not self.memory:
            return [unavailable("CUDA memory", self.reason), *oom]
        out: list[Text] = []
        for m in self.memory:
            if len(self.memory) > 1:
                out.append(Text(f"cuda:{m.device}", style="bold underline"))
            frag = next((f for f in self.frag if f.device == m.device), None)
            out += device_lines(
                m, frag, self.peak_window.get(m.device, m.window_peak), self.retry_rate, width
            )
        return out + oom

    def render(self) -> RenderableType:
        return Group(*self.lines(max(40, self.content_size.width)))

    def plain(self, width: int = 100) -> str:
        return "\n".join(t.plain for t in self.lines(width))
