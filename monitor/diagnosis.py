"""What holds the run back, in plain words with the numbers: pure functions over RunState.

One primary verdict (`data-loading`, `transfer`, `compute`, `host-overhead`; `unknown` while
there are too few steps) with a severity, and independent flags (`memory-pressure`,
`fragmentation`, `dataloader-workers`, `memory-leak`). A monitor follows one agent, so one rank:
there is no straggler flag (it would need every rank's steps side by side).
Every threshold is in THRESHOLDS below and in the README; each rule is a function of `Facts`, so
each is tested at its thresholds without sockets or a UI.

Where the numbers come from (public rules this starts from):
- input share bands 5% / 20% (TensorFlow input-pipeline analysis: < 5% not input-bound,
  5-20% moderately, >= 20% highly); >= 50% is `critical` here (more than half the step waits).
- GPU utilisation < 50% and peak memory > 90% of the device (PyTorch TensorBoard profiler plugin).
- reserved >= 2x allocated with reserved >= 30% of the device (TraceML) as one fragmentation sign.
Hysteresis: the verdict in force is re-judged with thresholds x0.8, so it does not flap between
neighbours on noise. Warm-up steps (the first 10, where compilation and caches fill) are not judged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

THRESHOLDS: dict[str, float] = {
    "warmup_steps": 10,  # first steps of a run are not judged (compilation, allocator warm-up)
    "min_steps": 5,  # fewer judged steps than this: verdict `unknown`
    "window_s": 10.0,  # judge the last 10 s or the last 50 steps, whichever holds more steps
    "window_steps": 50,
    "input_moderate": 0.05,  # data wait / transfer share of step time: info
    "input_high": 0.20,  # warning
    "input_severe": 0.50,  # critical
    "hysteresis": 0.8,  # the verdict in force keeps its thresholds scaled by this
    "gpu_util_low": 50.0,  # percent (NVML): below it, with the host busy, the GPU waits on Python
    "gpu_util_very_low": 25.0,  # critical
    "memory_high": 0.90,  # reserved or window peak / device total: warning
    "memory_critical": 0.97,
    "frag_external": 0.5,  # 1 - largest free block / free inside segments
    "frag_free_share": 0.2,  # ... with at least this share of reserved memory free but split
    "frag_free_min_bytes": 256 * 2**20,
    "frag_reserved_ratio": 2.0,  # reserved >= 2x allocated ...
    "frag_reserved_device": 0.3,  # ... while reserved >= 30% of the device
    # mean CPU percent of the DataLoader workers above which they are the limit: psutil over 1 s
    # windows under-reads a busy worker on a shared machine (81% seen for one that never rested)
    "worker_saturated": 75.0,
    "leak_growth": 0.10,  # memory grew >= 10% over the leak horizon ...
    "leak_min_span_s": 10.0,  # ... measured over at least this long ...
    "leak_horizon_s": 60.0,
    "leak_monotonic": 0.7,  # ... with at least 70% of the changes upward
}
T = THRESHOLDS
SEVERITY_RANK = {"ok": 0, "info": 1, "warning": 2, "critical": 3}


@dataclass(frozen=True)
class Finding:
    kind: str
    severity: str
    share: float
    evidence: tuple[str, ...] = ()
    advice: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "severity": self.severity, "share": round(self.share, 4),
                "evidence": list(self.evidence), "advice": list(self.advice)}


@dataclass(frozen=True)
class Diagnosis:
    verdict: Finding
    flags: tuple[Finding, ...] = ()
    steps: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"verdict": self.verdict.to_json(), "flags": [f.kind for f in self.flags],
                "flag_details": [f.to_json() for f in self.flags]}


@dataclass
class Facts:
    """Everything the rules look at, reduced from the state (tests build it directly)."""

    steps: int
    step_ms: float
    shares: dict[str, float]
    ms: dict[str, float]
    device: str = "cpu"
    device_ms: dict[str, float] = field(default_factory=dict)
    gpu_util: float = -1.0  # mean NVML utilisation over the window, -1 unknown
    proc_cpu: float = -1.0  # mean training-process CPU percent
    cores: int = 0
    workers: int = -1  # DataLoader worker processes, -1 unknown
    worker_cpu: float = -1.0  # their mean CPU percent
    mem_total: int = 0
    reserved: int = 0
    allocated: int = 0
    window_peak: int = 0
    inactive_split: int = 0
    retry_rate: float = 0.0
    ooms: int = 0
    frag_external: float = 0.0
    frag_free: int = 0
    expandable: bool = False
    growth: tuple[float, float, float, float] | None = None  # (first, last, span_s, upward share)
    growth_what: str = "allocated"


def _pct(x: float) -> str:
    return f"{x * 100:.0f}%"


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _band(share: float, scale: float = 1.0) -> str | None:
    if share >= T["input_severe"] * scale:
        return "critical"
    if share >= T["input_high"] * scale:
        return "warning"
    if share >= T["input_moderate"] * scale:
        return "info"
    return None


# -- primary verdict rules -----------------------------------------------------------------------
def rule_data(f: Facts, scale: float = 1.0) -> Finding | None:
    share = f.shares.get("data", 0.0)
    if _band(share, scale) is None:
        return None
    severity = _band(share) or "info"  # hysteresis keeps the verdict; it does not raise the severity
    evidence = [f"data wait is {_pct(share)} of step time: {f.ms.get('data', 0):.1f} ms of {f.step_ms:.1f} ms"]
    if f.workers == 0:
        evidence.append("no DataLoader worker processes: loading runs on the training process")
    elif f.workers > 0 and f.worker_cpu >= 0:
        evidence.append(f"{f.workers} DataLoader workers at {f.worker_cpu:.0f}% CPU on average ({f.cores} cores)")
    advice = []
    if f.workers <= 0 or (f.worker_cpu >= T["worker_saturated"] and f.cores > f.workers + 1):
        advice.append(f"raise DataLoader num_workers (try {max(2, f.cores - 1)}) with persistent_workers=True")
    advice.append("make per-sample work cheaper: precompute/cache decoded data, move augmentation to the GPU")
    advice.append("pin_memory=True and a larger prefetch_factor smooth out uneven batches")
    return Finding("data-loading", severity, share, tuple(evidence), tuple(advice[:3]))


def rule_transfer(f: Facts, scale: float = 1.0) -> Finding | None:
    host = f.shares.get("h2d", 0.0)
    dev_step = f.device_ms.get("step", 0.0)
    dev = f.device_ms.get("h2d", 0.0) / dev_step if dev_step > 0 else 0.0
    share = max(host, dev)
    if _band(share, scale) is None:
        return None
    severity = _band(share) or "info"  # hysteresis keeps the verdict; it does not raise the severity
    evidence = [f"host-to-device copies take {_pct(host)} of step time ({f.ms.get('h2d', 0):.1f} ms of {f.step_ms:.1f} ms)"]
    if dev > 0:
        evidence.append(f"on the GPU the copies take {_pct(dev)} of the step ({f.device_ms.get('h2d', 0):.1f} ms)")
    advice = (
        "DataLoader(pin_memory=True) and .to(device, non_blocking=True): pinned copies overlap compute",
        "send compact dtypes (uint8 images, int32 tokens) and convert on the GPU",
        "keep static data on the GPU instead of copying it every step",
    )
    return Finding("transfer", severity, share, tuple(evidence), advice)


def rule_host_overhead(f: Facts, scale: float = 1.0) -> Finding | None:
    if f.device != "cuda" or f.gpu_util < 0:
        return None
    if f.shares.get("data", 0.0) >= T["input_moderate"] or f.shares.get("h2d", 0.0) >= T["input_moderate"]:
        return None
    low = T["gpu_util_low"] / scale if scale < 1 else T["gpu_util_low"]
    if f.gpu_util >= low:
        return None
    severity = "critical" if f.gpu_util < T["gpu_util_very_low"] else "warning"
    evidence = [f"GPU busy {f.gpu_util:.0f}% of the time (NVML) with no data or transfer wait"]
    if f.proc_cpu >= 0:
        evidence.append(f"the training process uses {f.proc_cpu:.0f}% CPU: Python and kernel launches set the pace")
    advice = (
        "torch.compile(model) (mode='reduce-overhead' adds CUDA graphs) fuses the many small kernels",
        "a larger batch size gives each launch more work",
        "avoid per-step host syncs (.item(), .cpu(), printing tensors) inside the loop",
    )
    return Finding("host-overhead", severity, 1.0 - f.gpu_util / 100.0, tuple(evidence), advice)


def rule_compute(f: Facts) -> Finding:
    share = sum(f.shares.get(k, 0.0) for k in ("forward", "backward", "optimizer"))
    evidence = [f"forward+backward+optimizer are {_pct(share)} of step time ({f.step_ms:.1f} ms a step)"]
    if f.device == "cuda" and f.gpu_util >= 0:
        evidence.append(f"GPU busy {f.gpu_util:.0f}% of the time (NVML)")
    other = f.shares.get("other", 0.0)
    if other >= T["input_high"]:
        evidence.append(f"{_pct(other)} of the step is outside the measured phases (logging, metrics, checkpoints?)")
    if f.device == "cuda":
        advice = ("mixed precision: torch.autocast('cuda', dtype=torch.bfloat16)", "torch.compile(model)",
                  "a fused optimizer (AdamW(fused=True)) and the largest batch that fits")
    else:
        advice = ("torch.compile(model) and bfloat16 autocast on CPUs that support it",
                  "set torch.set_num_threads() to the physical cores", "train on a GPU if one is available")
    return Finding("compute", "ok", share, tuple(evidence), advice)


VERDICT_RULES = {"data-loading": rule_data, "transfer": rule_transfer, "host-overhead": rule_host_overhead}


def primary(f: Facts, previous: str | None = None) -> Finding:
    """The verdict: the worst bottleneck past its threshold, else compute (the healthy case)."""
    found = []
    for kind, rule in VERDICT_RULES.items():
        result = rule(f, T["hysteresis"] if kind == previous else 1.0)
        if result is not None:
            found.append(result)
    if not found:
        return rule_compute(f)
    return max(found, key=lambda x: (SEVERITY_RANK[x.severity], x.kind == previous, x.share))
