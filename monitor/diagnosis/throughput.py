"""Is the GPU busy with useful work: throughput, MFU, device busy time beside NVML's utilisation.

- samples/s and tokens/s: a step's samples (tokens) × steps/s. A step's samples come from the
  user's marks `samples` / `tokens` when there are (torchtop.agent.mark), else from the batch
  shape the agent read in the FLOP-counted step (the root's input: its first dimension; tokens
  for a 2-D integer input), summed over micro-batches.
- MFU (as torchtitan and Lightning's ThroughputMonitor compute it): FLOPs a step ÷ step time ÷
  the device's peak FLOP/s for the dtype that carries most of the FLOPs (peaks.py, or the run's
  own peak). The FLOPs are counted once, over one step: where the judged steps' batches vary
  (tokens, else samples) that count stands for none of them and MFU is unknown; a figure above
  100% is refused (the count does not match these steps). Where the GPU's counters (GPM) give
  an MFU and the FLOP count's is missing or 10 points or more away, the counters' is shown, and why.
- device busy: the sampled steps' CUDA-event time inside the measured phases ÷ their step time
  on the device. NVML's utilisation is the share of time any kernel runs, however small: "100%"
  with a low MFU is a trickle of small kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import mean, median
from typing import TYPE_CHECKING, Any

import msgspec

from torchtop.monitor.diagnosis.facts import THRESHOLDS as T
from torchtop.monitor.diagnosis.peaks import lookup, precision
from torchtop.monitor.diagnosis.report_types import ThroughputReport
from torchtop.monitor.model.fmt import pct
from torchtop.monitor.model.state import device_ms

if TYPE_CHECKING:
    from torchtop.contract.wire import FlopInfo
    from torchtop.monitor.diagnosis.gpm import GpmFigures
    from torchtop.monitor.model.steps import StepRecord

DEVICE_PHASES = ("h2d", "forward", "backward", "optimizer")
FROM_FLOPS = "flop count"
FROM_COUNTERS = "gpu counters"
SAME_WORK = 0.05  # batches within 5% of the median step's are the same shape
ODD_STEPS = 0.10  # ... and up to this share of steps may differ (an epoch's last, shorter batch)


@dataclass
class Throughput:
    steps_per_s: float = 0.0
    step_ms: float = 0.0
    samples_per_s: float | None = None
    samples_from: str = ""  # "mark" | "batch shape"
    tokens_per_s: float | None = None
    tokens_from: str = ""
    flops_per_step: int | None = None
    flops_from: str = ""  # "counted" | "given"
    achieved_tflops: float | None = None
    precision: str = ""  # the dtype carrying most FLOPs, as the peak table names it ("bf16", "tf32")
    peak_tflops: float | None = None
    peak_from: str = ""  # "H100 SXM (datasheet)" | "the run's TORCHTOP_PEAK_TFLOPS"
    mfu: float | None = None
    device_busy: float | None = None  # share of the device step inside the measured phases
    device_busy_ms: float | None = None
    device_step_ms: float | None = None
    gpu_util: float | None = None  # NVML, mean over the window
    flops_note: str = ""  # why there is no FLOP count ("counting", "off: ...")
    flop_mfu: float | None = None  # what the FLOP count gives, as counted (above 1.0 too): mfu-disagree's
    mfu_from: str = ""  # FROM_FLOPS | FROM_COUNTERS ("" with no MFU)
    mfu_note: str = ""  # why MFU is unknown, or why it is the counters'

    def to_report(self) -> ThroughputReport:
        def r(x: float | None, n: int = 4) -> float | None:
            return None if x is None else float(f"{x:.{n}g}")  # significant digits: TFLOP/s of a CPU are tiny

        return ThroughputReport(
            steps_per_s=r(self.steps_per_s),
            samples_per_s=r(self.samples_per_s, 6),
            samples_from=self.samples_from or None,
            tokens_per_s=r(self.tokens_per_s, 6),
            tokens_from=self.tokens_from or None,
            flops_per_step=self.flops_per_step,
            flops_from=self.flops_from or None,
            flops_note=self.flops_note or None,
            achieved_tflops=r(self.achieved_tflops),
            precision=self.precision or None,
            peak_tflops=r(self.peak_tflops, 5),
            peak_from=self.peak_from or None,
            mfu=r(self.mfu),
            device_busy=r(self.device_busy),
            device_busy_ms=r(self.device_busy_ms),
            device_step_ms=r(self.device_step_ms),
            gpu_util=r(self.gpu_util, 3),
            mfu_from=self.mfu_from or None,
            mfu_note=self.mfu_note or None,
        )

    def to_json(self) -> dict[str, Any]:
        return msgspec.to_builtins(self.to_report())


def _mark_mean(steps: list[StepRecord], name: str) -> float | None:
    values = [s.marks[name] for s in steps if name in s.marks]
    return mean(values) if values else None


def shapes_vary(steps: list[StepRecord]) -> str | None:
    """How the steps' batches differ, where more than ODD_STEPS of the steps whose batch was
    seen are more than SAME_WORK off the median step's tokens (else samples); None: alike, or unseen."""
    seen = [s for s in steps if s.samples]
    if len(seen) < 2:
        return None
    tokens = all(s.tokens for s in seen)
    values = [s.tokens if tokens else s.samples for s in seen]
    mid = median(values)
    odd = sum(1 for v in values if abs(v - mid) > SAME_WORK * mid)
    if odd <= ODD_STEPS * len(values):
        return None
    return f"{'tokens' if tokens else 'samples'} {min(values):,}-{max(values):,} a step"


def mfu_line(t: Throughput) -> str | None:
    """MFU in words: the figure and where it comes from, or why it is unknown; None: nothing to say."""
    if t.mfu is None:
        return f"MFU unknown: {t.mfu_note}" if t.mfu_note else None
    if t.mfu_from == FROM_COUNTERS or t.achieved_tflops is None or t.peak_tflops is None:
        return f"MFU {pct(t.mfu, 0)} {t.mfu_note}".rstrip()
    return f"MFU {pct(t.mfu, 0)}: {t.achieved_tflops:.1f} of {t.peak_tflops:.0f} TFLOP/s ({t.peak_from})"


def _judged_mfu(t: Throughput, steps: list[StepRecord], counters: GpmFigures | None) -> None:
    """`t.mfu` from the FLOP count where it stands for these steps and is possible, else the
    GPU's counters' (also where they disagree with the count), each with why."""
    note = ""
    vary = shapes_vary(steps) if t.flop_mfu is not None else None
    if vary is not None:
        note = f"the batch shapes vary ({vary}): the one step the FLOPs were counted over stands for none"
        t.achieved_tflops = None
    elif t.flop_mfu is not None and t.flop_mfu > 1.0:
        note = (
            f"the FLOP count does not match these steps: it gives {pct(t.flop_mfu, 0)} of the "
            f"{t.peak_tflops:.0f} TFLOP/s peak"
        )
    elif t.flop_mfu is not None:
        t.mfu, t.mfu_from = t.flop_mfu, FROM_FLOPS
    counter = counters.counter_mfu if counters is not None else None
    if counter is not None and (t.mfu is None or abs(counter - t.mfu) >= T.mfu_disagree):
        why = note or (
            f"the FLOP count gives {pct(t.mfu, 0)}: it misses work the tensor cores do, or counts work they skip"
            if t.mfu is not None
            else ""
        )
        active = counters.tensor_active if counters is not None else None
        t.mfu, t.mfu_from = counter, FROM_COUNTERS
        note = f"from the GPU's counters (tensor cores active {active or 0:.0f}%, at the SM clock)" + (
            f"; {why}" if why else ""
        )
    t.mfu_note = note


def throughput(
    steps: list[StepRecord],
    flops: FlopInfo | None,
    device_name: str,
    gpu_util: float | None = None,
    counters: GpmFigures | None = None,
) -> Throughput:
    """The figures over `steps` (training steps, the FLOP-counted one already left out);
    `counters`: the GPU's GPM figures, where it has them."""
    t = Throughput(gpu_util=gpu_util)
    if not steps:
        return t
    t.step_ms = sum(s.wall_ns for s in steps) / len(steps) / 1e6
    t.steps_per_s = 1000.0 / t.step_ms if t.step_ms > 0 else 0.0
    per_step = _mark_mean(steps, "samples")
    if per_step is not None:
        t.samples_per_s, t.samples_from = per_step * t.steps_per_s, "mark"
    elif flops is not None and flops.samples:
        t.samples_per_s, t.samples_from = flops.samples * t.steps_per_s, "batch shape"
    tokens = _mark_mean(steps, "tokens")
    if tokens is not None:
        t.tokens_per_s, t.tokens_from = tokens * t.steps_per_s, "mark"
    elif flops is not None and flops.tokens:
        t.tokens_per_s, t.tokens_from = flops.tokens * t.steps_per_s, "batch shape"
    dev = device_ms(steps)
    if dev.get("step", 0.0) > 0:
        busy = sum(dev.get(k, 0.0) for k in DEVICE_PHASES)
        t.device_busy_ms, t.device_step_ms = busy, dev["step"]
        t.device_busy = min(1.0, busy / dev["step"])
    if flops is None or flops.state != "done" or flops.flops <= 0:
        if flops is not None:
            t.flops_note = f"{flops.state}: {flops.reason}" if flops.reason else flops.state
        _judged_mfu(t, steps, counters)
        return t
    t.flops_per_step, t.flops_from = flops.flops, flops.source
    t.achieved_tflops = flops.flops * t.steps_per_s / 1e12
    dtype = max(flops.by_dtype, key=lambda k: flops.by_dtype[k]) if flops.by_dtype else ""
    t.precision = precision(dtype, flops.tf32) if dtype else ""
    if flops.peak_tflops:
        t.peak_tflops, t.peak_from = flops.peak_tflops, "the run's own peak (TORCHTOP_PEAK_TFLOPS)"
    elif device_name and t.precision:
        found = lookup(device_name, t.precision)
        if found is not None:
            t.peak_from, t.peak_tflops = f"{found[0]} {t.precision} (datasheet, dense)", found[1]
    if t.peak_tflops:
        t.flop_mfu = t.achieved_tflops / t.peak_tflops
    _judged_mfu(t, steps, counters)
    return t
