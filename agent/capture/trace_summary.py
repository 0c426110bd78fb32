"""Summarise a Chrome trace from torch.profiler: the step breakdown in the PyTorch profiler
plugin's buckets and the GPU idle share. Pure Python over the trace events (no torch), so it is
tested on hand-made events and runs on the agent's writer thread, never the training thread.

Each instant of a ProfilerStep goes to the highest-priority bucket active then, in the plugin's
order: Kernel, Memcpy, Memset, Communication, Runtime, DataLoader, CPU Exec, Other.
"""

from __future__ import annotations

from typing import Any

BUCKETS = ("Kernel", "Memcpy", "Memset", "Communication", "Runtime", "DataLoader", "CPU Exec", "Other")
GPU_BUCKETS = ("Kernel", "Memcpy", "Memset", "Communication")

Interval = tuple[float, float]


def _union(intervals: list[Interval]) -> list[Interval]:
    out: list[Interval] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def _subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """a minus b, both sorted and disjoint."""
    out: list[Interval] = []
    j = 0
    for start, end in a:
        cur = start
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < end:
            out.append((cur, end))
    return out


def _length(intervals: list[Interval]) -> float:
    return sum(e - s for s, e in intervals)


STOP_SYNC_SLACK_US = 1000.0  # the profiler's own bookkeeping after its drain, before the span closes


def _profiler_stop_sync(events: list[dict[str, Any]], last: Interval) -> dict[str, Any] | None:
    """The cudaDeviceSynchronize torch.profiler runs when it stops (inside the last step's span,
    running to its end): it waits for the queued GPU work, which is accounted for by the kernels."""
    for e in reversed(events):
        if (
            e.get("ph") == "X"
            and e.get("name") == "cudaDeviceSynchronize"
            and float(e["ts"]) >= last[0]
            and float(e["ts"]) + float(e.get("dur", 0)) >= last[1] - STOP_SYNC_SLACK_US
        ):
            return e
    return None


QUEUED_US = 200.0  # a first kernel starting this long after its launch waited behind earlier work
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _backlog_end(events: list[dict[str, Any]], start: float) -> float | None:
    """When work queued before the capture (not in the trace) kept the GPU busy as the first step
    began: its first profiled GPU activity ran long after its launch. Returns when it ran."""
    first: dict[str, Any] | None = None
    for e in events:
        if e.get("ph") == "X" and str(e.get("cat", "")) in GPU_CATS and float(e["ts"]) >= start:
            if first is None or float(e["ts"]) < float(first["ts"]):
                first = e
    corr = (first or {}).get("args", {}).get("correlation")
    if first is None or corr is None:
        return None
    for e in events:
        if (
            e.get("ph") == "X"
            and str(e.get("cat", "")) in ("cuda_runtime", "cuda_driver")
            and e.get("args", {}).get("correlation") == corr
        ):
            return float(first["ts"]) if float(first["ts"]) - float(e["ts"]) > QUEUED_US else None
    return None


def bucket_of(event: dict[str, Any]) -> str | None:
    cat = str(event.get("cat", "")).lower()
    name = str(event.get("name", ""))
    if cat == "kernel":
        return "Communication" if "nccl" in name.lower() else "Kernel"
    if cat == "gpu_memcpy":
        return "Memcpy"
    if cat == "gpu_memset":
        return "Memset"
    if cat in ("cuda_runtime", "cuda_driver"):
        return "Runtime"
    if cat in ("cpu_op", "user_annotation"):
        if name.startswith("ProfilerStep#"):
            return None
        if "DataLoader" in name:
            return "DataLoader"
        return "CPU Exec"
    return None


def summarize(events: list[dict[str, Any]]) -> dict[str, Any]:
    """{"steps", "step_ms" (mean), "buckets" (share of step time each), "gpu_idle" (or None)}."""
    # A step's time runs from its host-side span's start to the end of its GPU-side span: the
    # GPU lags the host, so its kernels run after the host has moved on (as the profiler plugin).
    host: dict[str, Interval] = {}
    gpu: dict[str, Interval] = {}
    for e in events:
        name = str(e.get("name", ""))
        if e.get("ph") != "X" or not name.startswith("ProfilerStep#"):
            continue
        span = (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
        side = gpu if str(e.get("cat", "")) == "gpu_user_annotation" else host
        side[name] = (min(span[0], side[name][0]), max(span[1], side[name][1])) if name in side else span
    steps = sorted(host, key=lambda n: host[n][0])
    busy_until = _backlog_end(events, host[steps[0]][0]) if steps else None
    if busy_until is not None:  # the GPU was not free for these steps before then: not idle
        for n in steps:
            host[n] = (max(host[n][0], busy_until), host[n][1])
    own_sync = _profiler_stop_sync(events, host[steps[-1]]) if steps else None
    if own_sync is not None:  # the profiler's own drain at stop: not the step's work
        last = steps[-1]
        host[last] = (host[last][0], min(host[last][1], float(own_sync["ts"])))
        events = [e for e in events if e is not own_sync]
    spans = _union(
        [(host[n][0], max(host[n][0], host[n][1], gpu[n][1] if n in gpu else host[n][1])) for n in steps]
    )
    total = _length(spans)
    by_bucket: dict[str, list[Interval]] = {b: [] for b in BUCKETS}
    any_gpu = False
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        bucket = bucket_of(e)
        if bucket is None:
            continue
        any_gpu = any_gpu or bucket in GPU_BUCKETS
        by_bucket[bucket].append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    assigned: list[Interval] = []
    shares: dict[str, float] = {}
    gpu_busy = 0.0
    for bucket in BUCKETS[:-1]:
        mine = _subtract(_subtract(spans, _subtract(spans, _union(by_bucket[bucket]))), assigned)
        length = _length(mine)
        shares[bucket] = length / total if total else 0.0
        if bucket in GPU_BUCKETS:
            gpu_busy += length
        assigned = _union(assigned + mine)
    shares["Other"] = max(0.0, 1.0 - sum(shares.values())) if total else 0.0
    return {
        "steps": len(steps),
        "step_ms": (total / len(steps) / 1000.0) if steps else 0.0,
        "buckets": {k: round(v, 5) for k, v in shares.items()},
        "gpu_idle": round(1.0 - gpu_busy / total, 5) if total and any_gpu else None,
    }
