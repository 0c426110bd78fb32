"""Why panel: throughput and MFU beside the phases, the GPU's busy time beside NVML's, the waits
on the GPU and the hot user code of each phase (stack samples).

The app sets `why` (diagnosis.why.WhyFacts over the panel's window) and `shares` (the probe's
phase shares, which are exact: the samples only split a phase among sites).
"""

from __future__ import annotations

from rich.console import RenderableType
from rich.table import Table
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from torchtop.contract.logcodes import PHASES
from torchtop.monitor.diagnosis.facts import THRESHOLDS as T
from torchtop.monitor.diagnosis.throughput import FROM_COUNTERS, mfu_line
from torchtop.monitor.diagnosis.why import WhyFacts, site_words
from torchtop.monitor.model import fmt
from torchtop.monitor.model.hotspots import short_site

SHOWN_PHASE = 0.05  # phases under this share of the step are not listed
SITES_A_PHASE = 2


def _si(x: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.3g}"


def why_rows(w: WhyFacts | None, shares: dict[str, float], step_ms: float) -> list[tuple[str, str]]:
    """(label, text) rows: throughput, FLOPs, GPU, sync, then hot sites per phase."""
    if w is None:
        return [("", "no data yet")]
    rows: list[tuple[str, str]] = []
    t = w.throughput
    parts = [f"{fmt.rate(t.steps_per_s)} steps/s"] if t.steps_per_s else []
    if t.samples_per_s is not None:
        parts.append(f"{_si(t.samples_per_s)} samples/s ({t.samples_from})")
    if t.tokens_per_s is not None:
        parts.append(f"{_si(t.tokens_per_s)} tokens/s ({t.tokens_from})")
    if parts:
        rows.append(("throughput", " · ".join(parts)))
    if t.achieved_tflops is not None:
        per_step = f" ({t.flops_per_step / 1e12:.3g} TFLOP a step)" if t.flops_per_step is not None else ""
        flops = f"{t.achieved_tflops:.3g} TFLOP/s achieved{per_step}"
        if t.mfu is not None and t.mfu_from != FROM_COUNTERS:
            flops += f" · MFU {fmt.pct(t.mfu)} of {t.peak_tflops:.0f} TFLOP/s ({t.peak_from})"
        elif t.precision and t.mfu is None and not t.mfu_note:
            flops += f" · no peak known for {t.precision} here: TORCHTOP_PEAK_TFLOPS gives MFU"
        rows.append(("FLOPs", flops))
    elif t.flops_note:
        rows.append(("FLOPs", t.flops_note))
    if (t.mfu is None or t.mfu_from == FROM_COUNTERS) and (line := mfu_line(t)):  # why none, or the counters'
        rows.append(("MFU", line))
    gpu = []
    if t.device_busy is not None:
        gpu.append(f"kernels span {fmt.pct(t.device_busy)} of the step (CUDA events)")
    if t.gpu_util is not None:
        gpu.append(f"NVML utilisation {t.gpu_util:.0f}%")
    if gpu:
        rows.append(("GPU", " · ".join(gpu)))
    fo = w.fold
    sync = w.sync
    if fo.sync and fo.samples:
        known = {s.site: s for s in (sync.sites if sync else [])}
        for site, n in sorted(fo.sync_by_site.items(), key=lambda x: -x[1])[:2]:
            rec = known.get(site)
            call = rec.call if rec is not None and rec.call else "a sync"
            share = n / fo.samples
            rows.append(
                (
                    "sync",
                    f"{call} at {short_site(site)} waits ~{share * step_ms:.1f} ms a step ({fmt.pct(share)})",
                )
            )
    elif sync is not None and sync.state in ("waiting", "off") and sync.reason:
        rows.append(("sync", sync.reason))
    elif sync is not None and sync.windows:
        rows.append(
            ("sync", f"no waits on the GPU seen ({sync.windows} {fmt.plural(sync.windows, 'window')})")
        )
    if fo.samples < T.min_stack_samples:
        samples = f"{fo.samples} stack {fmt.plural(fo.samples, 'sample')}"
        rows.append(("code", f"{samples} in the window so far ({w.stack_hz:g} Hz)"))
        return rows
    for phase in sorted(PHASES, key=lambda p: -shares.get(p, 0.0)):
        share = shares.get(phase, 0.0)
        sites = fo.sites.get(phase, [])
        if share < SHOWN_PHASE or not sites or fo.by_phase.get(phase, 0) < T.min_phase_samples:
            continue
        rows.append(
            (f"{phase} {fmt.pct(share)}", " · ".join(site_words(s, " ") for s in sites[:SITES_A_PHASE]))
        )
    return rows


class WhyPanel(Widget):
    """What the steps do with the hardware, and where in the code the host time goes."""

    why: reactive[WhyFacts | None] = reactive(None, layout=True)
    shares: reactive[dict[str, float]] = reactive(dict)
    step_ms: reactive[float] = reactive(0.0)

    def on_mount(self) -> None:
        self.border_title = "why · throughput, MFU, hot code"

    def watch_why(self, w: WhyFacts | None) -> None:
        if w is not None and w.stack_hz:
            self.border_subtitle = f"stack samples: {w.fold.samples} at {w.stack_hz:g} Hz"
        else:
            self.border_subtitle = ""

    def render(self) -> RenderableType:
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold", no_wrap=True)
        grid.add_column(ratio=1)
        for label, text in why_rows(self.why, self.shares, self.step_ms):
            grid.add_row(label, Text(text))
        return grid

    def plain(self) -> str:
        return "\n".join(
            f"{label} {text}".strip() for label, text in why_rows(self.why, self.shares, self.step_ms)
        )
