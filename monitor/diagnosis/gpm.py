"""How busy the GPU really is, from its GPM counters: beside NVML's utilisation and the FLOP MFU.

NVML's utilisation is the share of time a kernel ran; GPM's SM activity is the share of SMs at
work, tensor-pipe activity the share of time tensor cores ran (agent/telemetry/gpm.py). The
counter-based MFU is tensor activity x SM clock / max SM clock (the OFU method: within ~2 points
of MFU on H100/GB200). Where it and the FLOP-based MFU disagree by 10 points or more, one of them
is wrong: a FLOP count that misses fused or custom kernels (or counts work that never runs), or
tensor cores left idle by fp32 matmuls. Pure; no textual, no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from torchtop.contract.wire import GpuSample
from torchtop.monitor.diagnosis.facts import THRESHOLDS as T
from torchtop.monitor.diagnosis.facts import Finding
from torchtop.monitor.model.fmt import pct

if TYPE_CHECKING:
    from torchtop.monitor.diagnosis.facts import Facts


class GpmFigures(NamedTuple):
    sm_active: float | None  # percent
    tensor_active: float | None  # percent
    counter_mfu: float | None  # fraction


def counter_mfu(g: GpuSample) -> float | None:
    if g.tensor_active is None or not g.sm_clock_mhz or not g.sm_clock_max_mhz:
        return None
    return max(0.0, min(1.0, g.tensor_active / 100.0 * g.sm_clock_mhz / g.sm_clock_max_mhz))


def figures(g: GpuSample | None) -> GpmFigures | None:
    """The GPU's counters, where GPM gave any."""
    if g is None or (g.sm_active is None and g.tensor_active is None):
        return None
    return GpmFigures(g.sm_active, g.tensor_active, counter_mfu(g))


def util_words(g: GpuSample) -> str:
    """`33% · SMs 0% busy`: NVML's utilisation, and the SMs' where GPM reads them."""
    util = f"{g.util_gpu:.0f}%" if g.util_gpu is not None else "?"
    return util + (f" · SMs {g.sm_active:.0f}% busy" if g.sm_active is not None else "")


def flag_mfu_disagree(f: Facts, scale: float = 1.0) -> Finding | None:
    """The counter-based and the FLOP-based MFU are 10 points or more apart (CUDA, GPM)."""
    g, w = f.gpm, f.why
    if g is None or g.counter_mfu is None or w is None or w.throughput.flop_mfu is None:
        return None
    flop, counter = w.throughput.flop_mfu, g.counter_mfu  # the count's own, though MFU shows the counters'
    gap = counter - flop
    if abs(gap) < T.mfu_disagree * scale:
        return None
    evidence = (
        f"MFU from the FLOP count {pct(flop, 0)}, from the GPU's counters {pct(counter, 0)} "
        f"(tensor cores active {g.tensor_active:.0f}% of the time, scaled by the SM clock)",
    )
    if gap > 0:
        advice = (
            "the FLOP count misses work the tensor cores do (fused, custom or compiled kernels): "
            "trust the counters, or give the FLOPs (torchtop.agent.start(flops_per_step=...))",
        )
    else:
        advice = (
            "the tensor cores are idle for FLOPs the count expects: fp32 matmuls (bf16 autocast), "
            "or a FLOP formula that counts too much",
        )
    return Finding("mfu-disagree", "info", abs(gap), evidence, advice)
