"""Where the agent's per-step cost goes: the CPU benchmark loop with one hook group removed at a
time (and the agent thread reduced to draining its buffer: `noproc`), modes interleaved round by
round, median of the per-round median step times.

    python tests/benchmarks/bench_hooks.py [ROUNDS]

Not collected by pytest. On an H100 host (16 cores, torch 2.11) one run gave: threads alone -0.9%,
full +19%, noproc +10%, without the h2d patches +6.7%: figures that disagree with
bench_overhead.py's +2.4% on the same loop, which is the next thing to explain.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import torchtop.agent as ta
from torchtop.agent import hooks, publisher

GROUPS = ("_patch_dataloader", "_hook_forward", "_patch_backward", "_patch_h2d", "_patch_grad_scaler", "_hook_optimizer")
MODES = ("off", "threads", "full", "noproc", *(f"-{g}" for g in GROUPS if g != "_patch_grad_scaler"))
ORIGINAL = {g: getattr(hooks.AutoHooks, g) for g in GROUPS}
ORIGINAL_TICK = publisher.AgentLoop._tick


def loop() -> Any:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 320), torch.nn.ReLU(), torch.nn.Linear(320, 320), torch.nn.ReLU(), torch.nn.Linear(320, 10)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    crit = torch.nn.CrossEntropyLoss()
    data = TensorDataset(torch.randn(64 * 400, 256), torch.randint(0, 10, (64 * 400,)))

    def block(n: int) -> float:
        it = iter(DataLoader(data, batch_size=64))
        times = []
        for _ in range(n):
            t = time.perf_counter_ns()
            x, y = next(it)
            loss = crit(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            times.append(time.perf_counter_ns() - t)
        return statistics.median(times) / 1000

    return block


def set_mode(name: str) -> None:
    for group, fn in ORIGINAL.items():
        setattr(hooks.AutoHooks, group, fn)
    publisher.AgentLoop._tick = ORIGINAL_TICK
    if name == "noproc":
        publisher.AgentLoop._tick = lambda self: self.buffer.drain()
    elif name.startswith("-"):
        setattr(hooks.AutoHooks, name[1:], lambda self: None)


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 25
    block = loop()
    results: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(rounds):
        for mode in MODES:
            if mode == "off":
                block(10)
                results[mode].append(block(80))
                continue
            set_mode(mode)
            ta.start(auto=mode != "threads")
            block(10)
            results[mode].append(block(80))
            ta.stop()
    set_mode("full")
    base = statistics.median(results["off"])
    for mode in MODES:
        v = statistics.median(results[mode])
        print(f"{mode:22s} {v:8.1f} us/step  delta {v - base:+7.1f} us ({(v - base) / base * 100:+.2f}%)")


if __name__ == "__main__":
    main()
