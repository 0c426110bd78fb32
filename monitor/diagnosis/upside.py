"""What a fix would buy: each verdict and flag's upside as a number from the measured phases.

A `bound` is the most a fix can give (the step cannot lose more than the time it names: removing
the data wait entirely; the GPU's own work stays). An `estimate` rests on a sampled figure or a
model of what follows the fix (stack samples, a sync's wait, a typical MFU). Memory findings buy
room, not time. Pure: a Finding and its Facts in, an Upside out.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

import msgspec

from torchtop.monitor.diagnosis.facts import Facts
from torchtop.monitor.diagnosis.report_types import UpsideReport
from torchtop.monitor.diagnosis.throughput import FROM_COUNTERS
from torchtop.monitor.diagnosis.why import device_busy_ms, host_code_share, sync_evidence
from torchtop.monitor.model.fmt import size
from torchtop.monitor.model.hotspots import short_site

Kind = Literal["bound", "estimate"]
GOOD_MFU = 0.4  # what a well-fed large model reaches (torchtitan's Llama runs: ~40-55% on H100)


@dataclass(frozen=True)
class Upside:
    text: str
    kind: Kind
    step_ms: float | None = None  # the step now
    new_step_ms: float | None = None  # the step after the fix (a floor for a bound)
    speedup: float | None = None  # steps/s after ÷ before

    def to_report(self) -> UpsideReport:
        def r(x: float | None) -> float | None:
            return None if x is None else round(x, 3)

        return UpsideReport(self.text, self.kind, r(self.step_ms), r(self.new_step_ms), r(self.speedup))

    def to_json(self) -> dict[str, Any]:
        return msgspec.to_builtins(self.to_report())


def faster(what: str, step: float, new: float, kind: Kind, note: str = "") -> Upside | None:
    """`what` would take the step from `step` to `new` ms: the speed-up as a sentence (None: none)."""
    if step <= 0 or new <= 0 or new >= step:
        return None
    x = step / new
    up = "up to " if kind == "bound" else "~"
    text = f"{what}: {up}{x:.1f}× steps/s ({step:.1f} → {new:.1f} ms a step; {kind}{note})"
    return Upside(text, kind, step, new, x)


def data_upside(f: Facts) -> Upside | None:
    return faster("removing the data wait", f.step_ms, f.step_ms - f.ms.get("data", 0.0), "bound")


def transfer_upside(f: Facts) -> Upside | None:
    h2d = f.ms.get("h2d", 0.0)
    if h2d <= 0:
        return None
    got = faster("overlapping the copies", f.step_ms, f.step_ms - h2d, "bound")
    if got is None:
        return None
    text = (
        f"pinned memory and non_blocking copies could overlap up to {h2d:.1f} ms of the {f.step_ms:.1f} ms "
        f"step: up to {got.speedup:.1f}× (bound)"
    )
    return replace(got, text=text)


def host_overhead_upside(f: Facts) -> Upside | None:
    busy, source = device_busy_ms(f)
    if busy is None or busy <= 0:
        return None
    kind: Kind = "bound" if source == "CUDA events" else "estimate"
    got = faster("the GPU's own work", f.step_ms, busy, kind)
    if got is None:
        return None
    text = (
        f"the GPU is busy {busy / f.step_ms:.0%} of the step ({source}): CUDA graphs / torch.compile could "
        f"cut up to {f.step_ms - busy:.1f} ms ({f.step_ms:.1f} → {busy:.1f} ms, up to {got.speedup:.1f}×; {kind})"
    )
    return replace(got, text=text)


def compute_upside(f: Facts) -> Upside | None:
    t = f.why.throughput if f.why is not None else None
    if t is None or t.mfu is None or t.mfu_from == FROM_COUNTERS or not t.flops_per_step or not t.peak_tflops:
        return None  # the counters' MFU says the FLOP count is off: no bound from it
    floor = t.flops_per_step / (t.peak_tflops * 1e12) * 1e3
    got = faster(
        f"at the peak FLOP/s (MFU {t.mfu:.0%} now)", f.step_ms, floor, "bound", ": no run reaches it"
    )
    return got


def sync_upside(f: Facts) -> Upside | None:
    share, _, _ = sync_evidence(f)
    if share <= 0:
        return None
    wait = share * f.step_ms
    busy, _ = device_busy_ms(f)
    # the GPU's work still runs: once the host stops waiting, it overlaps the host's own time
    new = max(f.step_ms - wait, busy or 0.0)
    return faster(
        "not waiting on the GPU", f.step_ms, new, "estimate", ": the GPU's work then overlaps the host's"
    )


def outside_upside(f: Facts) -> Upside | None:
    """Issue 18's outside-phases verdict, where no stack sample says where yet."""
    return faster(
        "without the time outside the phases", f.step_ms, f.step_ms - f.ms.get("other", 0.0), "bound"
    )


def host_code_upside(f: Facts) -> Upside | None:
    share, sites = host_code_share(f)
    if not sites:
        return None
    spent = share * sites[0].share * f.step_ms
    return faster(
        f"taking {short_site(sites[0].site)} off the step",
        f.step_ms,
        f.step_ms - spent,
        "estimate",
        ": stack samples",
    )


def low_mfu_upside(f: Facts) -> Upside | None:
    t = f.why.throughput if f.why is not None else None
    if t is None or not t.flops_per_step or not t.peak_tflops:
        return None
    new = t.flops_per_step / (GOOD_MFU * t.peak_tflops * 1e12) * 1e3
    return faster(f"at {GOOD_MFU:.0%} MFU (a well-fed GPU)", f.step_ms, new, "estimate")


def memory_pressure_upside(f: Facts) -> Upside | None:
    if f.mem_total <= 0:
        return None
    left = max(0, f.mem_total - max(f.reserved, f.window_peak))
    return Upside(f"room: {size(left)} left of {size(f.mem_total)} before out-of-memory", "bound")


def fragmentation_upside(f: Facts) -> Upside | None:
    free = max(f.frag_free, f.reserved - f.allocated)
    if free <= 0:
        return None
    return Upside(f"up to {size(free)} of the cache usable again for large blocks", "bound")


def memory_leak_upside(f: Facts) -> Upside | None:
    g = f.growth
    if g is None or g.span_s <= 0 or g.last <= g.first:
        return None
    last, rate = g.last, (g.last - g.first) / g.span_s * 60
    text = f"stops a growth of {size(rate)} a minute"
    if f.mem_total > 0 and "CUDA" in f.growth_what:
        left = max(0, f.mem_total - last)
        text += f" (the device fills in ~{left / rate:.0f} min at this rate)"
    return Upside(text, "estimate")
