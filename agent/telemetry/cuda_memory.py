"""CUDA caching-allocator figures and fragmentation, sampled off the training thread.

`memory_stats()` is too costly for every step, so it runs with the agent's tick; the cost of
`memory_snapshot()` (without traces) grows with the blocks, so its interval adapts to stay under
0.02% of wall time, every 2 s at most (figures: docs/benchmarks.md). Neither waits for queued GPU work. Nothing here initialises CUDA: the
sampler is created only once the user's code has.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torchtop.contract.wire import FragSample, MemorySample

if TYPE_CHECKING:
    from types import ModuleType

# share of wall time the snapshot and its reading may take: fragmentation moves over minutes, and
# at 0.1% it was most of the slow thread's cost while a monitor listened (~1 ms a second on an H200)
SNAPSHOT_BUDGET = 0.0002
SNAPSHOT_MIN_INTERVAL = 2.0
SNAPSHOT_MAX_INTERVAL = 30.0
_BUCKETS = ((2 << 20, "<=2MiB"), (20 << 20, "<=20MiB"), (200 << 20, "<=200MiB"), (2 << 30, "<=2GiB"))


def _bucket(size: int) -> str:
    for limit, name in _BUCKETS:
        if size <= limit:
            return name
    return ">2GiB"


def fragmentation(segments: list[dict[str, Any]], device: int) -> FragSample:
    """Fragmentation figures of one device from memory_snapshot() segments (pure)."""
    largest = total = count = 0
    hist: dict[str, int] = {}
    expandable = False
    for seg in segments:
        if seg.get("device", device) != device:
            continue
        count += 1
        expandable = expandable or bool(seg.get("is_expandable", False))
        name = _bucket(int(seg.get("total_size", 0)))
        hist[name] = hist.get(name, 0) + 1
        for block in seg.get("blocks", ()):
            if block.get("state") == "inactive":  # only inactive blocks are free
                size = int(block.get("size", 0))
                total += size
                largest = max(largest, size)
    external = 1.0 - largest / total if total else 0.0
    if not expandable:
        expandable = (
            "expandable_segments:true"
            in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower()
        )
    return FragSample(
        device=device,
        largest_free=largest,
        total_free=total,
        external=external,
        segments=count,
        segment_hist=hist,
        expandable=expandable,
    )


class CudaMemorySampler:
    def __init__(self, torch: ModuleType) -> None:
        self.torch = torch
        self._last_peak: dict[int, int] = {}
        self.snapshot_interval = SNAPSHOT_MIN_INTERVAL
        self._next_snapshot = 0.0

    def devices(self) -> list[int]:
        """Devices this process holds memory on (the current one at least)."""
        cuda = self.torch.cuda
        found = [i for i in range(cuda.device_count()) if cuda.memory_reserved(i) > 0]
        return found or [cuda.current_device()]

    def _flat(self, device: int) -> Callable[[str, int], Any]:
        """A getter of the allocator's statistics by memory_stats()'s dotted keys. From the
        nested dict torch builds (torch._C._cuda_memoryStats) where this torch has it:
        memory_stats() flattens every key in Python, ~0.2 ms of GIL a tick for the dozen read."""
        cuda = self.torch.cuda
        nested = getattr(getattr(self.torch, "_C", None), "_cuda_memoryStats", None)
        if nested is None or not cuda.is_initialized():
            return cuda.memory_stats(device).get
        st = nested(device)

        def get(key: str, default: int) -> Any:
            node: Any = st
            for part in key.split("."):
                if not isinstance(node, dict) or part not in node:
                    return default
                node = node[part]
            return node

        return get

    def stats(self, device: int) -> MemorySample:
        cuda = self.torch.cuda
        g = self._flat(device)
        peak = int(g("allocated_bytes.all.peak", 0))
        current = int(g("allocated_bytes.all.current", 0))
        last_peak = self._last_peak.get(device)
        # a rise of the all-time peak since the previous sample is this window's peak
        window_peak = peak if last_peak is not None and peak > last_peak else current
        self._last_peak[device] = peak
        try:
            free, total = cuda.mem_get_info(device)
        except Exception:  # broad: a device that cannot say: its free memory unknown
            free, total = 0, 0
        fraction = self._fraction(device)
        return MemorySample(
            device=device,
            allocated=current,
            reserved=int(g("reserved_bytes.all.current", 0)),
            active=int(g("active_bytes.all.current", 0)),
            requested=int(g("requested_bytes.all.current", 0)),
            inactive_split=int(g("inactive_split_bytes.all.current", 0)),
            peak_allocated=peak,
            peak_reserved=int(g("reserved_bytes.all.peak", 0)),
            window_peak=window_peak,
            alloc_retries=int(g("num_alloc_retries", 0)),
            ooms=int(g("num_ooms", 0)),
            device_total=int(total * fraction),
            device_free=int(free),
            limit_fraction=fraction,
        )

    def _fraction(self, device: int) -> float:
        """The allocator's cap from set_per_process_memory_fraction (1.0 without one, or on a
        torch too old to say): pressure is judged against what the process may use."""
        get = getattr(self.torch.cuda, "get_per_process_memory_fraction", None)
        try:
            fraction = float(get(device)) if get is not None else 1.0
        except Exception:  # broad: a torch that cannot say: the whole device
            return 1.0
        return fraction if 0.0 < fraction < 1.0 else 1.0

    def snapshot_due(self, now: float | None = None) -> bool:
        return (now if now is not None else time.monotonic()) >= self._next_snapshot

    def frag(self, devices: list[int]) -> list[FragSample]:
        """Fragmentation per device; reschedules itself to stay under the wall-time budget."""
        cuda = self.torch.cuda
        t = time.perf_counter()
        try:
            segments = cuda.memory_snapshot(include_traces=False)
        except TypeError:  # torch without include_traces
            segments = cuda.memory_snapshot()
        out = [fragmentation(segments, d) for d in devices]
        cost = time.perf_counter() - t  # the reading of the segments in Python included
        self.snapshot_interval = min(
            SNAPSHOT_MAX_INTERVAL, max(SNAPSHOT_MIN_INTERVAL, cost / SNAPSHOT_BUDGET)
        )
        self._next_snapshot = time.monotonic() + self.snapshot_interval
        for sample in out:
            sample.cost_ms = cost * 1000
            sample.interval_s = self.snapshot_interval
        return out
