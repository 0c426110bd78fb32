"""The independent flags of the diagnosis: memory pressure, fragmentation, DataLoader workers,
memory growth. Pure functions of `Facts`; thresholds live in diagnosis.THRESHOLDS."""

from __future__ import annotations

from torchtop.monitor.diagnosis.facts import THRESHOLDS as T
from torchtop.monitor.diagnosis.facts import Facts, Finding
from torchtop.monitor.diagnosis.why import WHY_FLAGS
from torchtop.monitor.model.fmt import pct, size


def flag_memory_pressure(f: Facts) -> Finding | None:
    if f.mem_total <= 0:
        return None
    used = max(f.reserved, f.window_peak) / f.mem_total
    retrying = f.retry_rate > 0
    if used < T["memory_high"] and not retrying and f.ooms == 0:
        return None
    severity = "critical" if used >= T["memory_critical"] or f.ooms > 0 else "warning"
    evidence = [
        f"reserved {size(f.reserved)} of {size(f.mem_total)} ({pct(f.reserved / f.mem_total, 0)}), "
        f"peak allocated {size(f.window_peak)}"
    ]
    if retrying:
        evidence.append(f"{f.retry_rate:.2f} allocator retries/s: each flushes the cache and stalls the step")
    if f.ooms:
        evidence.append(f"{f.ooms} out-of-memory errors so far")
    advice = (
        "activation checkpointing (torch.utils.checkpoint) on the largest blocks",
        "mixed precision (bf16) halves activations",
        "a smaller micro-batch with gradient accumulation",
    )
    return Finding("memory-pressure", severity, used, tuple(evidence), advice)


def flag_fragmentation(f: Facts) -> Finding | None:
    """Fragmentation that costs something: allocator retries with memory sitting free in the
    cache, or a large cache (>= 30% of the device) most of which cannot serve one big block.

    Between steps a healthy run's cache is full of freed activations spread over many segments,
    so "external fragmentation" alone is normal; it matters once it forces cudaMalloc retries
    (each flushes the cache and stalls) or holds a big share of the card.
    """
    if f.reserved <= 0:
        return None
    free_in_cache = max(f.frag_free, f.reserved - f.allocated)
    split = f.frag_external >= T["frag_external"] and f.frag_free >= max(
        T["frag_free_min_bytes"], T["frag_free_share"] * f.reserved
    )
    bloated = f.allocated > 0 and f.reserved >= T["frag_reserved_ratio"] * f.allocated
    big = f.mem_total > 0 and f.reserved >= T["frag_reserved_device"] * f.mem_total
    retrying = f.retry_rate > 0 and free_in_cache >= 0.1 * f.reserved
    if not (retrying or ((split or bloated) and big)):
        return None
    evidence = []
    if retrying:
        evidence.append(
            f"{f.retry_rate:.2f} allocator retries/s while {size(free_in_cache)} sat free in the cache"
        )
    if f.frag_free:
        evidence.append(
            f"{size(f.frag_free)} free inside segments but {pct(f.frag_external, 0)} of it is "
            "unusable for one large block (external fragmentation)"
        )
    evidence.append(
        f"reserved {size(f.reserved)} for {size(f.allocated)} allocated; "
        f"{size(f.inactive_split)} cached in split blocks"
    )
    advice = []
    if not f.expandable:
        advice.append(
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lets segments grow instead of splitting"
        )
    advice.append("bucket or pad variable shapes (sequence lengths, image sizes) to a few sizes")
    advice.append("allocate long-lived buffers first, before the training loop")
    severity = "critical" if retrying else "warning"
    return Finding("fragmentation", severity, f.frag_external, tuple(evidence), tuple(advice))


def flag_dataloader_workers(f: Facts) -> Finding | None:
    data = f.shares.get("data", 0.0)
    if data < T["input_moderate"] or f.workers is None:
        return None
    severity = "warning" if data >= T["input_high"] else "info"
    if f.workers == 0:
        return Finding(
            "dataloader-workers",
            severity,
            data,
            (f"num_workers=0 while data wait is {pct(data, 0)} of the step",),
            (f"DataLoader(num_workers={max(2, f.cores - 1)}, persistent_workers=True)",),
        )
    if f.worker_cpu is not None and f.worker_cpu >= T["worker_saturated"]:
        if f.cores > f.workers + 1:
            advice = (f"raise num_workers from {f.workers} toward {f.cores - 1} (cores are free)",)
        else:
            advice = ("all cores are busy: make the per-sample work cheaper or move it to the GPU",)
        return Finding(
            "dataloader-workers",
            severity,
            data,
            (f"{f.workers} workers at {f.worker_cpu:.0f}% CPU each: saturated",),
            advice,
        )
    return None


def flag_memory_leak(f: Facts) -> Finding | None:
    if f.growth is None:
        return None
    first, last, span, upward = f.growth
    if first <= 0 or span < T["leak_min_span_s"]:
        return None
    grew = (last - first) / first
    if grew < T["leak_growth"] or upward < T["leak_monotonic"]:
        return None
    evidence = (
        f"{f.growth_what} grew {size(first)} -> {size(last)} (+{pct(grew, 0)}) in {span:.0f} s, steadily",
    )
    advice = (
        "look for tensors kept across steps: losses or outputs appended to a list without .item()/.detach()",
        "a memory snapshot (key m) shows the allocation sites that keep growing",
    )
    return Finding("memory-leak", "warning", grew, evidence, advice)


FLAG_RULES = (flag_memory_pressure, flag_fragmentation, flag_dataloader_workers, flag_memory_leak, *WHY_FLAGS)
