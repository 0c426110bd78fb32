"""What holds the run back, in plain words with the numbers: pure functions of `Facts`.

One primary verdict (`data-loading`, `transfer`, `host-overhead`, else `compute`; `unknown` with
too few steps) with a severity; the independent flags are in flags.py. A monitor follows one
rank, so there is no straggler flag. Thresholds (and the public rules they start from: README,
"What the verdict means") are in facts.THRESHOLDS. The verdict in force is re-judged with its
thresholds x0.8 (hysteresis), so it does not flap between neighbours on noise.
"""

from __future__ import annotations

from torchtop.monitor.diagnosis.facts import SEVERITY_RANK, Facts, Finding, Severity
from torchtop.monitor.diagnosis.facts import THRESHOLDS as T
from torchtop.monitor.diagnosis.why import WHY_VERDICTS, refine
from torchtop.monitor.model.fmt import pct


def _band(share: float, scale: float = 1.0) -> Severity | None:
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
    evidence = [
        f"data wait is {pct(share, 0)} of step time: {f.ms.get('data', 0):.1f} ms of {f.step_ms:.1f} ms"
    ]
    if f.workers == 0:
        evidence.append("no DataLoader worker processes: loading runs on the training process")
    elif f.workers and f.worker_cpu is not None:
        evidence.append(
            f"{f.workers} DataLoader workers at {f.worker_cpu:.0f}% CPU on average ({f.cores} cores)"
        )
    advice = []
    saturated = f.worker_cpu is not None and f.worker_cpu >= T["worker_saturated"]
    if not f.workers or (saturated and f.cores > f.workers + 1):
        advice.append(
            f"raise DataLoader num_workers (try {max(2, f.cores - 1)}) with persistent_workers=True"
        )
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
    evidence = [
        f"host-to-device copies take {pct(host, 0)} of step time ({f.ms.get('h2d', 0):.1f} ms of {f.step_ms:.1f} ms)"
    ]
    if dev > 0:
        evidence.append(
            f"on the GPU the copies take {pct(dev, 0)} of the step ({f.device_ms.get('h2d', 0):.1f} ms)"
        )
    advice = (
        "DataLoader(pin_memory=True) and .to(device, non_blocking=True): pinned copies overlap compute",
        "send compact dtypes (uint8 images, int32 tokens) and convert on the GPU",
        "keep static data on the GPU instead of copying it every step",
    )
    return Finding("transfer", severity, share, tuple(evidence), advice)


def rule_host_overhead(f: Facts, scale: float = 1.0) -> Finding | None:
    if f.device != "cuda" or f.gpu_util is None:
        return None
    if f.shares.get("data", 0.0) >= T["input_moderate"] or f.shares.get("h2d", 0.0) >= T["input_moderate"]:
        return None
    low = T["gpu_util_low"] / scale if scale < 1 else T["gpu_util_low"]
    if f.gpu_util >= low:
        return None
    severity = "critical" if f.gpu_util < T["gpu_util_very_low"] else "warning"
    evidence = [f"GPU busy {f.gpu_util:.0f}% of the time (NVML) with no data or transfer wait"]
    if f.proc_cpu is not None:
        evidence.append(
            f"the training process uses {f.proc_cpu:.0f}% CPU: Python and kernel launches set the pace"
        )
    advice = (
        "torch.compile(model) (mode='reduce-overhead' adds CUDA graphs) fuses the many small kernels",
        "a larger batch size gives each launch more work",
        "avoid per-step host syncs (.item(), .cpu(), printing tensors) inside the loop",
    )
    return Finding("host-overhead", severity, 1.0 - f.gpu_util / 100.0, tuple(evidence), advice)


def rule_compute(f: Facts) -> Finding:
    share = sum(f.shares.get(k, 0.0) for k in ("forward", "backward", "optimizer"))
    evidence = [f"forward+backward+optimizer are {pct(share, 0)} of step time ({f.step_ms:.1f} ms a step)"]
    if f.device == "cuda" and f.gpu_util is not None:
        evidence.append(f"GPU busy {f.gpu_util:.0f}% of the time (NVML)")
    other = f.shares.get("other", 0.0)
    if other >= T["input_high"]:
        evidence.append(
            f"{pct(other, 0)} of the step is outside the measured phases (logging, metrics, checkpoints?)"
        )
    if f.device == "cuda":
        advice = (
            "mixed precision: torch.autocast('cuda', dtype=torch.bfloat16)",
            "torch.compile(model)",
            "a fused optimizer (AdamW(fused=True)) and the largest batch that fits",
        )
    else:
        advice = (
            "torch.compile(model) and bfloat16 autocast on CPUs that support it",
            "set torch.set_num_threads() to the physical cores",
            "train on a GPU if one is available",
        )
    return Finding("compute", "ok", share, tuple(evidence), advice)


VERDICT_RULES = {"data-loading": rule_data, "transfer": rule_transfer, "host-overhead": rule_host_overhead}
VERDICT_RULES.update(WHY_VERDICTS)  # sync, host-code: why.py


def primary(f: Facts, previous: str | None = None) -> Finding:
    """The verdict: the worst bottleneck past its threshold, else compute (the healthy case)."""
    found = []
    for kind, rule in VERDICT_RULES.items():
        result = rule(f, T["hysteresis"] if kind == previous else 1.0)
        if result is not None:
            found.append(result)
    if not found:
        return refine(rule_compute(f), f)
    return refine(max(found, key=lambda x: (SEVERITY_RANK[x.severity], x.kind == previous, x.share)), f)
