"""Gradient accumulation whose micro-batches are pulled with `next()` from a plain generator
(issue 39); no torchtop in it.

    TORCHTOP=1 python tests/loops/grad_accum_next.py [--seconds 600] [--wrapped]

Each optimizer step takes 4 micro-batches with `x, y = next(src)`; the generator sleeps 2 ms a
batch (a reader waiting on its source) and the model is small, so a person says the loop waits
on its data most of the step. With --wrapped the generator goes through `torchtop.agent.data()`
(still pulled with next()). Prints "warm" after 20 steps, then every 5 steps "data share X": the
share of the time since then spent inside next().
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

ACCUMULATE = 4


def batches(batch_size: int, wait_s: float) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    while True:
        time.sleep(wait_s)  # the source's latency
        yield torch.randn(batch_size, 64, generator=g), torch.randint(0, 10, (batch_size,), generator=g)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--wait-ms", type=float, default=2.0)
    p.add_argument("--wrapped", action="store_true", help="wrap the generator in torchtop.agent.data()")
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # a tiny model: a thread pool only spins on a loaded machine
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    src = batches(32, args.wait_ms / 1e3)
    if args.wrapped:
        import torchtop.agent

        src = torchtop.agent.data(src)
    end = time.monotonic() + args.seconds
    waited, warm_at, step = 0.0, 0.0, 0
    while time.monotonic() < end:
        step += 1
        for _ in range(ACCUMULATE):
            t = time.perf_counter()
            x, y = next(src)
            if step > 20:  # the truth: the time inside next()
                waited += time.perf_counter() - t
            loss = F.cross_entropy(model(x), y) / ACCUMULATE
            loss.backward()
        opt.step()
        opt.zero_grad()
        if step == 20:
            warm_at = time.perf_counter()
            print("warm", flush=True)
        elif step > 20 and step % 5 == 0:
            print(f"data share {waited / (time.perf_counter() - warm_at):.3f}", flush=True)


if __name__ == "__main__":
    main()
