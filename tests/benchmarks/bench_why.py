"""What "why" costs, piece by piece, on CPU (not collected by pytest).

    python tests/benchmarks/bench_why.py [--samples N]

- the stack sampler: one `sample()` of a training thread that runs a real CPU loop with the
  agent's hooks, taken from another thread after a 50 ms sleep as the sampler thread does (cold
  caches) and back to back (warm); its thread CPU time, most of which holds the GIL;
- a sync window: what one synchronising call costs the training thread while a window is open
  (the warning torch raises goes through Python's warnings machinery to the window's hook), timed
  here with a warning raised from Python at a call site, against the same call with no window
  (on CUDA torch raises it from C: docs/why.md);
- the FLOP count: the counted step against the steps around it (it runs once).
The paired benchmark (bench_paired.py --attached) gives the sampler's share of a step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
import warnings
from types import SimpleNamespace
from typing import Any

import torch

import torchtop.agent as ta
from torchtop.agent.hooks.sync_window import MESSAGE, SyncWindow


def _mlp_loop() -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 320), torch.nn.ReLU(), torch.nn.Linear(320, 320), torch.nn.ReLU(), torch.nn.Linear(320, 10))  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = torch.utils.data.TensorDataset(torch.randn(4096, 256), torch.randint(0, 10, (4096,)))
    loader = torch.utils.data.DataLoader(data, batch_size=64)

    def step(x: Any, y: Any) -> None:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    return loader, step


def sampler_cost(agent: Any, n: int) -> dict[str, float]:
    loader, step = _mlp_loop()
    sampler = agent.why.sampler
    stop = threading.Event()
    cold: list[int] = []
    warm: list[int] = []

    def take() -> None:
        for _ in range(n):
            time.sleep(0.05)  # the sampler's sleep between samples: its caches go cold
            t = time.thread_time_ns()
            sampler.sample()
            cold.append(time.thread_time_ns() - t)
            t = time.thread_time_ns()
            sampler.sample()
            warm.append(time.thread_time_ns() - t)
        stop.set()

    th = threading.Thread(target=take)
    th.start()
    while not stop.is_set():
        for x, y in loader:
            step(x, y)
            if stop.is_set():
                break
    th.join()
    return {"cold_us": statistics.median(cold) / 1e3, "warm_us": statistics.median(warm) / 1e3}


def _call_site(k: int) -> None:
    warnings.warn(MESSAGE + " (Triggered internally at CUDAFunctions.cpp:1.)", UserWarning, stacklevel=1)


def window_cost(agent: Any, n: int) -> dict[str, float]:
    """Per synchronising call on the training thread: with a window open, and the warning's
    bare cost with the window's filter but no hook (Python prints nothing: an ignore filter)."""
    fake = SimpleNamespace(cuda=SimpleNamespace(mode=0))
    fake.cuda.get_sync_debug_mode = lambda: fake.cuda.mode
    fake.cuda.set_sync_debug_mode = lambda m: setattr(fake.cuda, "mode", m)
    probe = agent.probe
    tid = probe.tid
    probe.tid = threading.get_ident()
    w = SyncWindow(fake, probe, agent.why.classifier, {})
    try:
        assert w.open()
        for k in range(100):
            _call_site(k)
        t = time.perf_counter_ns()
        for k in range(n):
            _call_site(k)
        with_window = (time.perf_counter_ns() - t) / n / 1e3
        hook_us = w.cost_ns / w.seen / 1e3
        w.close()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=MESSAGE)
            t = time.perf_counter_ns()
            for k in range(n):
                _call_site(k)
            ignored = (time.perf_counter_ns() - t) / n / 1e3
    finally:
        probe.tid = tid
    return {"per_sync_us": with_window, "hook_us": hook_us, "warning_ignored_us": ignored}


def flop_step_cost(agent: Any) -> dict[str, float]:
    """The counted step (counted once, at the 12th step of the sampler's loop above) against
    the median of 100 ordinary steps."""
    loader, step = _mlp_loop()
    times: list[float] = []
    while len(times) < 100:
        for x, y in loader:
            t = time.perf_counter()
            step(x, y)
            times.append(time.perf_counter() - t)
    f = agent.why.flops
    return {
        "counted_step_ms": f.cost_ms or 0.0,
        "median_step_ms": statistics.median(times) * 1e3,
        "flops": f.flops,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--samples", type=int, default=400)
    args = p.parse_args(argv)
    os.environ.setdefault("TORCHTOP_QUIET", "1")
    os.environ.setdefault("TORCHTOP_RUNTIME_DIR", tempfile.mkdtemp(prefix="torchtop-bench-"))
    torch.set_num_threads(1)
    agent = ta.start()
    if agent is None:
        raise SystemExit("the agent did not start")
    try:
        s = sampler_cost(agent, args.samples)
        print(
            f"stack sampler: one sample {s['cold_us']:.1f} us after a 50 ms sleep, {s['warm_us']:.1f} us back to back (thread CPU, median)"
        )
        print(f"  at 20 Hz: {20 * s['cold_us'] / 1e4:.3f}% of a core, most of it holding the GIL")
        w = window_cost(agent, 20_000)
        print(
            f"sync window: {w['per_sync_us']:.2f} us per synchronising call while a window is open "
            f"(the window's hook {w['hook_us']:.2f} us of it; the same warning with an ignore filter "
            f"{w['warning_ignored_us']:.2f} us); none outside the windows"
        )
        f = flop_step_cost(agent)
        print(
            f"FLOP count: the counted step {f['counted_step_ms']:.1f} ms against a median step of "
            f"{f['median_step_ms']:.2f} ms, once ({f['flops'] / 1e6:.1f} MFLOP a step)"
        )
    finally:
        ta.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
