"""What each telemetry sampler costs the agent's threads (median of repeated calls), and the
share of one core that makes at the rate each runs. On CUDA with a few hundred live blocks so the
allocator snapshot has work to do.

    python tests/benchmarks/bench_samplers.py

Its figures go in docs/benchmarks.md (a dated section per round).
"""

from __future__ import annotations

import statistics
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


def row(name: str, us: float, hz: float) -> None:
    print(f"  {name:34s} {us:10.1f} us/call  at {hz:5.1f} Hz: {us * hz / 1e4:7.4f}% of one core")


def main() -> None:
    print(f"torch {torch.__version__}; publisher {RATE_HZ:g} Hz, slow sampler {1 / SLOW_PERIOD_S:g} Hz")
    host = HostSampler()
    row("psutil host sample (incl. children)", cost_us(host.sample, 50), 1 / SLOW_PERIOD_S)
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
    row(f"memory_snapshot() ({blocks} blocks)", snap, 1 / mem.snapshot_interval)
    print(f"    -> snapshot interval adapted to {mem.snapshot_interval:.1f} s")
    nvml = NvmlSampler()
    if nvml.available:
        row("NVML util/mem/power/temp/clock/throttle", cost_us(lambda: nvml.sample(dev)), RATE_HZ)
        row("NVML PCIe tx+rx (own slow timer)", cost_us(lambda: nvml.pcie(dev), 5), 1 / SLOW_PERIOD_S)
    else:
        print(f"  NVML: {nvml.reason}")


if __name__ == "__main__":
    main()
