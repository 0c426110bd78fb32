"""GPU panel: each GPU of the process from NVML — utilisation, memory, power, heat, clocks, PCIe.

The app sets `gpus` (wire.GpuSample list) or, without NVML or CUDA, `reason`. Figures the
agent could not read arrive as None and are left out rather than shown as zero.
Colours: memory >= 80% / 90% of the GPU, temperature >= 80 / 90 °C, power >= 95% of the limit,
any throttle reason other than idle.
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from torchtop.contract.wire import GpuSample
from torchtop.monitor.diagnosis.gpm import counter_mfu, util_words
from torchtop.monitor.model import fmt
from torchtop.monitor.model.energy import Energy
from torchtop.monitor.model.fmt import LEVELS, Level
from torchtop.monitor.tui.widgets.meter import (
    LEVEL_STYLES,
    bar_width,
    meter,
    pairs,
    set_level_class,
    unavailable,
)

BENIGN_THROTTLE = {"idle", "app-clocks", "display-clocks", "sync-boost"}  # agent/telemetry/nvml.py names


def temp_level(c: float | None) -> Level:
    return "ok" if c is None else fmt.level(c, 80.0, 90.0)


def gpu_level(g: GpuSample) -> Level:
    """The worst of memory share, temperature and power against its limit."""
    levels: list[Level] = [fmt.level(g.mem_used / g.mem_total if g.mem_total else 0.0), temp_level(g.temp_c)]
    if g.power_w is not None and g.power_limit_w:
        levels.append(fmt.level(g.power_w / g.power_limit_w, 0.95, 1.01))
    if any(t not in BENIGN_THROTTLE for t in g.throttle):
        levels.append("warning")
    return max(levels, key=LEVELS.index)


def gpu_lines(g: GpuSample, width: int) -> list[Text]:
    lines = [Text.assemble((f"GPU {g.index}", "bold"), ("  " + (g.name or "unknown GPU"), ""))]
    util = ""
    if g.util_gpu is not None:
        util = util_words(g) + (f" · memory controller {g.util_mem:.0f}%" if g.util_mem is not None else "")
    share = g.mem_used / g.mem_total if g.mem_total else 0.0
    memory = f"{fmt.size(g.mem_used)} / {fmt.size(g.mem_total)} · {fmt.pct(share)}" if g.mem_total else ""
    bar_w = bar_width(width, [util, memory], most=30)
    if g.util_gpu is not None:
        lines.append(meter("util", g.util_gpu / 100, bar_w, util))
    if g.mem_total:
        lines.append(meter("memory", share, bar_w, memory, fmt.level(share)))
    items: list[tuple[str, str] | tuple[str, str, str]] = []
    if g.power_w is not None:
        limit = f" / {g.power_limit_w:.0f}" if g.power_limit_w else ""
        lvl = fmt.level(g.power_w / g.power_limit_w, 0.95, 1.01) if g.power_limit_w else "ok"
        items.append(
            ("power", f"{g.power_w:.0f}{limit} W", f"bold {LEVEL_STYLES[lvl]}" if lvl != "ok" else "bold")
        )
    if g.temp_c is not None:
        lvl = temp_level(g.temp_c)
        items.append(("temp", f"{g.temp_c:.0f} °C", f"bold {LEVEL_STYLES[lvl]}" if lvl != "ok" else "bold"))
    if g.sm_clock_mhz is not None:
        items.append(("SM clock", f"{g.sm_clock_mhz:.0f} MHz"))
    pcie = [
        f"{way} {fmt.throughput(kbs)}"
        for way, kbs in (("tx", g.pcie_tx_kbs), ("rx", g.pcie_rx_kbs))
        if kbs is not None
    ]
    if pcie:
        items.append(("PCIe", " · ".join(pcie)))
    if items:
        lines.append(pairs(*items, width=width))
    gpm = [
        f"{what} {v:.0f}%"
        for what, v in (("occupancy", g.sm_occupancy), ("tensor", g.tensor_active), ("DRAM", g.dram_bw))
        if v is not None
    ]
    mfu = counter_mfu(g)
    if mfu is not None:
        gpm.append(f"counter MFU {fmt.pct(mfu)}")
    if g.nvlink_tx_mibs is not None and g.nvlink_rx_mibs is not None:
        gpm.append(f"NVLink {g.nvlink_tx_mibs:.0f}/{g.nvlink_rx_mibs:.0f} MiB/s")
    if gpm:
        lines.append(pairs(("GPM", " · ".join(gpm)), width=width))
    if g.throttle:
        bad = any(t not in BENIGN_THROTTLE for t in g.throttle)
        lines.append(pairs(("throttle", ", ".join(g.throttle), "bold yellow" if bad else "bold")))
    return lines


def energy_line(e: Energy, source: str, width: int) -> Text | None:
    """One counter's mean watts and joules a step over the window (model/energy.py); None: unknown."""
    src = e.sources.get(source)
    if src is None or not e.steps:
        return None
    items: list[tuple[str, str] | tuple[str, str, str]] = [
        ("energy", f"{src.joules / e.steps:.3g} J/step", "bold"),
        ("mean", f"{src.watts:.0f} W"),
    ]
    return pairs(*items, width=width)


def energy_total(e: Energy, width: int, label: str | None = None) -> Text | None:
    """The run's joules a step / sample / token and mean watts (its GPUs summed, else the CPU
    packages'); `label`: the line's name (default: what it sums)."""
    if e.joules_per_step is None:
        return None
    what = label or ("all GPUs" if e.from_ == "gpu" else "CPU energy (RAPL)")
    per = [f"{e.joules_per_step:.3g} J/step"]
    per += [
        f"{v:.3g} J/{unit}"
        for v, unit in ((e.joules_per_sample, "sample"), (e.joules_per_token, "token"))
        if v
    ]
    if e.watts is not None:
        per.append(f"{e.watts:.0f} W mean over {e.span_s:.0f} s")
    return pairs((what, " · ".join(per)), width=width)


class GpuPanel(Widget):
    gpus: reactive[list[GpuSample]] = reactive(list, layout=True)
    reason: reactive[str] = reactive("", layout=True)
    energy: reactive[Energy | None] = reactive(None, layout=True)  # the window's; None: no counter

    def on_mount(self) -> None:
        self.border_title = "GPU · NVML"

    def watch_gpus(self, gpus: list[GpuSample]) -> None:
        levels: list[Level] = [gpu_level(g) for g in gpus]  # kept Literal: a list display widens to str
        set_level_class(self, max(levels, key=LEVELS.index) if levels else "ok")

    def lines(self, width: int = 100) -> list[Text]:
        e = self.energy
        if not self.gpus:
            cpu = energy_total(e, width) if e is not None else None
            return [unavailable("GPU", self.reason), *([cpu] if cpu is not None else [])]
        out: list[Text] = []
        several = len(self.gpus) > 1
        for g in self.gpus:
            out += gpu_lines(g, width)
            line = energy_line(e, f"gpu{g.index}", width) if e is not None and several else None
            if line is not None:
                out.append(line)
        label = "energy" if e is not None and e.from_ == "gpu" and not several else None
        total = energy_total(e, width, label) if e is not None else None
        if total is not None:
            out.append(total)
        return out

    def render(self) -> RenderableType:
        return Group(*self.lines(max(40, self.content_size.width)))

    def plain(self, width: int = 100) -> str:
        return "\n".join(t.plain for t in self.lines(width))
