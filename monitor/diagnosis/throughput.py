"""Is the GPU busy with useful work: throughput, MFU, device busy time beside NVML's utilisation.

- samples/s and tokens/s: a step's samples (tokens) × steps/s. A step's samples come from the
  user's marks `samples` / `tokens` when there are (torchtop.agent.mark), else from the batch
  shape the agent read in the FLOP-counted step (the root's input: its first dimension; tokens
  for a 2-D integer input), summed over micro-batches.
- MFU (as torchtitan and Lightning's ThroughputMonitor compute it): FLOPs a step ÷ step time ÷
  the device's peak FLOP/s for the dtype that carries most of the FLOPs (peaks.py, or the run's
  own peak). The FLOPs are counted once; a run whose steps change shape keeps that one count.
- device busy: the sampled steps' CUDA-event time inside the measured phases ÷ their step time
  on the device. NVML's utilisation is the share of time any kernel runs, however small: "100%"
  with a low MFU is a trickle of small kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import mean
from typing import TYPE_CHECKING, Any

import msgspec

from torchtop.monitor.diagnosis.peaks import lookup, precision
from torchtop.monitor.diagnosis.report_types import ThroughputReport
from torchtop.monitor.model.state import device_ms

if TYPE_CHECKING:
    from torchtop.contract.wire import FlopInfo
    from torchtop.monitor.model.steps import StepRecord

DEVICE_PHASES = ("h2d", "forward", "backward", "optimizer")


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
        )

    def to_json(self) -> dict[str, Any]:
        return msgspec.to_builtins(self.to_report())


def _mark_mean(steps: list[StepRecord], name: str) -> float | None:
    values = [s.marks[name] for s in steps if name in s.marks]
    return mean(values) if values else None


def throughput(
    steps: list[StepRecord], flops: FlopInfo | None, device_name: str, gpu_util: float | None = None
) -> Throughput:
    """The figures over `steps` (training steps, the FLOP-counted one already left out)."""
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
        t.mfu = t.achieved_tflops / t.peak_tflops
    return t
