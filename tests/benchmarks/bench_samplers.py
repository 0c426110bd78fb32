"""What each telemetry sampler costs the agent's threads (median of repeated calls), and the
share of one core that makes at the rate each runs. On CUDA with a few hundred live blocks so the
allocator snapshot has work to do.

    python tests/benchmarks/bench_samplers.py

Its figures go in docs/benchmarks.md (a dated section per round).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable

import torch

from torchtop.agent.loop.loop import RATE_HZ
from torchtop.agent.telemetry.collector import SLOW_PERIOD_S
from torchtop.agent.telemetry.host import HostSampler


def cost_us(fn: Callable[[], object], n: int = 100) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def cpu_us(fn: Callable[[], object], n: int = 20) -> float:
    """This thread's CPU time a call (median): a C call that sleeps or waits is not counted."""
    times = []
    for _ in range(n):
        t = time.thread_time_ns()
        fn()
        times.append(time.thread_time_ns() - t)
    return statistics.median(times) / 1e3


def gil_us(fn: Callable[[], object], seconds: float = 1.0) -> float:
    """The GIL a call holds against a Python thread that wants it (what a training thread would
    wait for): a pure-Python loop's lost iterations while `fn` runs in a loop on another thread,
    as time, a call. NVML's ctypes calls release the GIL; Python around them does not."""

    def spin() -> int:
        n, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            n += 1
        return n

    base = spin()
    stop, calls = threading.Event(), [0]

    def loop() -> None:
        while not stop.is_set():
            fn()
            calls[0] += 1

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    got = spin()
    stop.set()
    t.join()
    return max(0.0, 1 - got / base) * seconds / max(1, calls[0]) * 1e6


def row(name: str, us: float, hz: float, fn: Callable[[], object] | None = None) -> None:
    extra = ""
    if fn is not None:
        extra = f"  (CPU {cpu_us(fn):8.1f} us, GIL held ~{gil_us(fn):8.1f} us a call)"
    print(f"  {name:34s} {us:10.1f} us/call  at {hz:5.1f} Hz: {us * hz / 1e4:7.4f}% of one core{extra}")


def main() -> None:
    print(f"torch {torch.__version__}; publisher {RATE_HZ:g} Hz, slow sampler {1 / SLOW_PERIOD_S:g} Hz")
    host = HostSampler()
    row("host sample (incl. children)", cost_us(host.sample, 50), 1 / SLOW_PERIOD_S, host.sample)
    if not torch.cuda.is_available():
        print("  (no CUDA: allocator and NVML samplers not measured)")
        return
    from torchtop.agent.telemetry.cuda_memory import CudaMemorySampler
    from torchtop.agent.telemetry.nvml import NvmlSampler

    keep = [torch.empty((1 + i % 37) * 65536, device="cuda") for i in range(2000)]
    del keep[::3]
    torch.cuda.synchronize()
    mem = CudaMemorySampler(torch)
    dev = torch.cuda.current_device()
    blocks = sum(len(s["blocks"]) for s in torch.cuda.memory_snapshot())
    row("memory_stats() + mem_get_info", cost_us(lambda: mem.stats(dev)), RATE_HZ)
    snap = cost_us(lambda: mem.frag([dev]), 30)
    row(f"memory_snapshot() ({blocks} blocks)", snap, 1 / mem.snapshot_interval, lambda: mem.frag([dev]))
    print(f"    -> snapshot interval adapted to {mem.snapshot_interval:.1f} s")
    nvml = NvmlSampler()
    if nvml.available:
        row(
            "NVML util/mem/power/temp/clock/throttle",
            cost_us(lambda: nvml.sample(dev)),
            RATE_HZ,
            lambda: nvml.sample(dev),
        )
        row(
            "NVML PCIe tx+rx (own slow timer)",
            cost_us(lambda: nvml.pcie(dev), 5),
            1 / SLOW_PERIOD_S,
            lambda: nvml.pcie(dev),
        )
        from torchtop.agent.telemetry.gpm import GpmSampler

        gpm = GpmSampler(nvml.nvml, nvml.handle)
        if gpm.supported(dev):
            row(
                "GPM sample + metrics",
                cost_us(lambda: gpm.read(dev), 20),
                1 / SLOW_PERIOD_S,
                lambda: gpm.read(dev),
            )
        else:
            print(f"  GPM: {gpm.reason}")
    else:
        print(f"  NVML: {nvml.reason}")


if __name__ == "__main__":
    main()
