"""The independent flags of the diagnosis: memory pressure, fragmentation, DataLoader workers,
memory growth. Pure functions of `Facts`; thresholds live in diagnosis.THRESHOLDS."""

from __future__ import annotations

from torchtop.monitor.diagnosis.facts import THRESHOLDS as T
from torchtop.monitor.diagnosis.facts import Facts, Finding, worker_busy
from torchtop.monitor.model.fmt import pct, size


def flag_memory_pressure(f: Facts, scale: float = 1.0) -> Finding | None:
    if f.mem_total <= 0:
        return None
    used = max(f.reserved, f.window_peak) / f.mem_total
    retrying = f.retry_rate > 0
    if used < T.memory_high and not retrying and f.ooms == 0:
        return None
    severity = "critical" if used >= T.memory_critical or f.ooms > 0 else "warning"
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


def flag_fragmentation(f: Facts, scale: float = 1.0) -> Finding | None:
    """Fragmentation that costs something: allocator retries with memory sitting free in the
    cache, or a large cache (>= 30% of the device) most of which cannot serve one big block.

    Between steps a healthy run's cache is full of freed activations spread over many segments,
    so "external fragmentation" alone is normal; it matters once it forces cudaMalloc retries
    (each flushes the cache and stalls) or holds a big share of the card.
    """
    if f.reserved <= 0:
        return None
    free_in_cache = max(f.frag_free, f.reserved - f.allocated)
    split = f.frag_external >= T.frag_external and f.frag_free >= max(
        T.frag_free_min_bytes, T.frag_free_share * f.reserved
    )
    bloated = f.allocated > 0 and f.reserved >= T.frag_reserved_ratio * f.allocated
    big = f.mem_total > 0 and f.reserved >= T.frag_reserved_device * f.mem_total
    retrying = f.retry_rate > 0 and free_in_cache >= 0.1 * f.reserved
    if not (retrying or ((split or bloated) and big)):
        return None
    evidence: list[str] = []
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
    advice: list[str] = []
    if not f.expandable:
        advice.append(
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lets segments grow instead of splitting"
        )
    advice.append("bucket or pad variable shapes (sequence lengths, image sizes) to a few sizes")
    advice.append("allocate long-lived buffers first, before the training loop")
    severity = "critical" if retrying else "warning"
    return Finding("fragmentation", severity, f.frag_external, tuple(evidence), tuple(advice))


def flag_dataloader_workers(f: Facts, scale: float = 1.0) -> Finding | None:
    """The loader is the bottleneck (data wait >= input_high, >= workers_min_ms a step) and its
    workers are why: there are none, they are saturated (busy on a CPU or waiting for one), or
    they keep the queue empty while mostly idle (waiting on I/O)."""
    data = f.shares.get("data", 0.0)
    if data < T.input_high or f.workers is None or f.ms.get("data", 0.0) < T.workers_min_ms:
        return None
    severity = "critical" if data >= T.input_severe else "warning"
    if f.workers == 0:
        return Finding(
            "dataloader-workers",
            severity,
            data,
            (
                f"no DataLoader worker processes while data wait is {pct(data, 0)} of the step "
                f"({f.ms.get('data', 0):.1f} ms): loading runs on the training thread",
            ),
            (f"DataLoader(num_workers={max(2, f.cores - 1)}, persistent_workers=True)",),
        )
    busy = worker_busy(f.worker_cpu, f.worker_wait)
    if busy is None:
        return None
    s = "" if f.workers == 1 else "s"
    waits = f" + {f.worker_wait:.0f}% waiting for a CPU" if f.worker_wait is not None else ""
    if busy >= T.worker_saturated:
        if f.worker_wait is not None and f.worker_wait >= T.worker_cpu_starved:
            advice = (
                "the workers wait for a CPU: the cores are taken (by this job or others), so more "
                "workers would not help; make the per-sample work cheaper or move it to the GPU",
            )
        elif f.cores > f.workers + 1:
            advice = (f"raise num_workers from {f.workers} toward {f.cores - 1} (cores are free)",)
        else:
            advice = ("all cores are busy: make the per-sample work cheaper or move it to the GPU",)
        evidence = (
            f"{f.workers} worker{s} saturated: busy {min(busy, 100.0):.0f}% ({f.worker_cpu:.0f}% CPU{waits})",
        )
        return Finding("dataloader-workers", severity, data, evidence, advice)
    if f.worker_wait is not None:  # known to be mostly idle while the loop waits on them: not CPU
        evidence = (
            f"the loop waits on data {pct(data, 0)} of the step while {f.workers} worker{s} are busy "
            f"only {busy:.0f}% of the time: they wait on something else (disk, network, a lock)",
        )
        advice = (
            "more workers overlap I/O waits; so does a larger prefetch_factor",
            "read from local disk or cache the dataset in memory",
        )
        return Finding("dataloader-workers", severity, data, evidence, advice)
    return None


LEAK_SITES = (  # the leak's last evidence on CUDA: what names its sites
    "a memory capture names the allocation sites that grow between its midpoint and its end: "
    "m (+ for more steps), or `torchtop capture PID --memory --steps 400`"
)


def flag_memory_leak(f: Facts, scale: float = 1.0) -> Finding | None:
    """Memory in use between steps rises steadily with the steps (Kendall's tau) over enough
    seconds and steps, is still rising at the end, grew visibly, and fast enough per step to
    matter: a slow run leaks per step too (growth.py)."""
    g = f.growth
    if g is None or g.first <= 0 or g.points < T.leak_min_points:
        return None
    if g.span_s < T.leak_min_span_s or g.span_steps < T.leak_min_steps:
        return None
    if g.trend < T.leak_trend or g.slope <= 0:
        return None
    if g.recent_slope < T.leak_still * g.slope:  # it rose, then settled: caches filling
        return None
    seen = (g.last - g.first) / g.first
    if seen < T.leak_seen or g.slope * T.leak_steps < T.leak_growth * g.first:
        return None
    evidence = (
        f"{f.growth_what} grew {size(g.first)} -> {size(g.last)} (+{pct(seen, 0)}) in {g.span_s:.0f} s "
        f"and {g.span_steps:.0f} steps, steadily: about {size(g.slope)} a step",
        *((f.oom.text(),) if f.oom is not None else ()),
        *((LEAK_SITES,) if "CUDA" in f.growth_what else ()),  # snapshots are CUDA's only
    )
    advice = (
        "look for tensors kept across steps: losses or outputs appended to a list without .item()/.detach()",
    )
    return Finding("memory-leak", "warning", seen, evidence, advice)


def flag_oom_forecast(f: Facts, scale: float = 1.0) -> Finding | None:
    """Memory in use rises steadily and reaches its limit within `oom_warning_s` at that rate
    (oom.py): a warning, critical within `oom_critical_s`; its share is the limit's share in use."""
    o = f.oom
    if o is None or o.seconds >= T.oom_warning_s:
        return None
    severity = "critical" if o.seconds < T.oom_critical_s else "warning"
    advice = (
        "look for tensors kept across steps: losses or outputs appended to a list without .item()/.detach()",
        "TORCHTOP_OOM_SNAPSHOT_AT=0.9 keeps a CUDA memory snapshot taken before the limit",
        "checkpoint now: the run will not reach its end at this rate",
    )
    return Finding("oom-forecast", severity, min(1.0, o.level / o.limit), (o.text(),), advice)
