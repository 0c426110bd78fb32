"""GPM on a real GPU (Hopper or newer): the counters against NVML's utilisation and the FLOP MFU.

    python tests/gpu/gpm_check.py

Three loops of ~4 s each, read with torchtop's own GPM sampler (agent/telemetry/gpm.py) at 1 Hz:
1. tiny kernels (64x64 adds, launch-bound): NVML utilisation > 20% while SM activity < 5%;
2. a bf16 8192x8192 matmul loop: tensor-pipe activity > 80%;
3. the same matmuls, FLOPs known (2 n^3 each): the counter-based MFU (tensor activity x SM clock /
   max SM clock) within 10 points of the FLOP-based one (achieved / the datasheet's dense bf16 peak).
Prints each figure; exit code 0 when all three hold, 2 where GPM is not supported (said once).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from torchtop.agent.telemetry.gpm import GpmSampler, counter_mfu  # noqa: E402
from torchtop.agent.telemetry.nvml import NvmlSampler  # noqa: E402
from torchtop.monitor.diagnosis.peaks import lookup  # noqa: E402


def watch(nv: NvmlSampler, gpm: GpmSampler, work, seconds: float = 4.0) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Run `work` for `seconds`, GPM read at 1 Hz; the means of the readings after the first."""
    gpm.read(0)
    utils, sms, tensors, clocks, maxes = [], [], [], [], []
    end = time.monotonic() + seconds
    next_read = time.monotonic() + 1.0
    n = 0
    t0 = time.perf_counter()
    while time.monotonic() < end:
        n += work()
        if time.monotonic() >= next_read:
            torch.cuda.synchronize()
            g = gpm.read(0)
            s = nv.sample(0)
            if g is not None:
                sms.append(g.sm_active or 0.0)
                tensors.append(g.tensor_active or 0.0)
                maxes.append(g.sm_clock_max_mhz or 0.0)
            if s.util_gpu is not None:
                utils.append(s.util_gpu)
            if s.sm_clock_mhz is not None:
                clocks.append(s.sm_clock_mhz)
            next_read += 1.0
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    return {
        "nvml_util": mean(utils),
        "sm_active": mean(sms),
        "tensor_active": mean(tensors),
        "sm_clock": mean(clocks),
        "sm_clock_max": mean(maxes),
        "work_per_s": n / dt,
    }


def main() -> int:
    nv = NvmlSampler()
    if not nv.available:
        print(f"NVML: {nv.reason}")
        return 2
    gpm = GpmSampler(nv.nvml, nv.handle)
    if not gpm.supported(0):
        print(f"GPM: {gpm.reason}")
        return 2
    dev = torch.device("cuda")
    small = torch.ones(64, 64, device=dev)

    def tiny() -> int:
        # launch-bound: kernels back to back from the host, each on a few of the SMs (with a sleep
        # between bursts the GPU idled most of the time and NVML read 7% on an H200)
        for _ in range(1000):
            small.add_(1.0)
        return 0

    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)

    def matmul() -> int:
        for _ in range(10):
            _ = a @ b
        return 10

    ok = True
    t = watch(nv, gpm, tiny)
    good = t["nvml_util"] > 20 and t["sm_active"] < 5
    ok &= good
    print(
        f"tiny kernels: NVML util {t['nvml_util']:.0f}%, SM activity {t['sm_active']:.1f}%: {'ok' if good else 'NO'}"
    )
    m = watch(nv, gpm, matmul)
    good = m["tensor_active"] > 80
    ok &= good
    print(
        f"bf16 matmul: NVML util {m['nvml_util']:.0f}%, SM {m['sm_active']:.1f}%, tensor {m['tensor_active']:.1f}%: "
        f"{'ok' if good else 'NO'}"
    )
    name = torch.cuda.get_device_name(0)
    peak = lookup(name, "bf16")
    flop_mfu = m["work_per_s"] * 2 * n**3 / 1e12 / peak[1] if peak else None
    cmfu = counter_mfu(m["tensor_active"], m["sm_clock"], m["sm_clock_max"])
    if peak is None or flop_mfu is None or cmfu is None:
        print(f"MFU: no peak for {name!r} or no clocks: not compared")
        ok = False
    else:
        good = abs(cmfu - flop_mfu) <= 0.10
        ok &= good
        print(
            f"MFU: from FLOPs {flop_mfu:.1%} ({peak[0]}), from counters {cmfu:.1%} "
            f"(SM clock {m['sm_clock']:.0f} of {m['sm_clock_max']:.0f} MHz): {'ok' if good else 'NO'}"
        )
    gpm.close()
    nv.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
