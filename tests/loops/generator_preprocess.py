"""A loop fed by a plain Python generator that does heavy preprocessing; no torchtop in it.

    TORCHTOP=1 python tests/loops/generator_preprocess.py [--seconds 600] [--wrapped]

Each batch is built sample by sample (normalise, several blur passes, a random crop) on the
training thread, and the model is small: most of each step is the generator, which no hook sees
(no DataLoader). A person says the loop is starved by its input. With --wrapped the generator
goes through `torchtop.agent.data()`, so its time is data wait. Prints "warm" after 20 steps, then
every 5 steps "data share X": the share of the time since then spent getting the next batch.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn


def batches(batch_size: int, passes: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    while True:
        xs, ys = [], []
        for _ in range(batch_size):
            img = torch.randn(3, 40, 40, generator=g)
            img = (img - img.mean()) / (img.std() + 1e-6)
            for _ in range(passes):
                img = 0.5 * img + 0.5 * F.avg_pool2d(img.unsqueeze(0), 3, 1, 1).squeeze(0)
            i, j = torch.randint(0, 8, (2,), generator=g).tolist()
            xs.append(img[:, i : i + 32, j : j + 32])
            ys.append(int(torch.randint(0, 10, (1,), generator=g)))
        yield torch.stack(xs), torch.tensor(ys)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--passes", type=int, default=12)
    p.add_argument("--wrapped", action="store_true", help="wrap the generator in torchtop.agent.data()")
    p.add_argument("--device", default="cpu", help="where the model trains (the generator runs on the CPU)")
    args = p.parse_args()
    torch.manual_seed(0)
    dev = torch.device(args.device)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 64), nn.ReLU(), nn.Linear(64, 10)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    source = batches(32, args.passes)
    if args.wrapped:
        import torchtop.agent

        source = torchtop.agent.data(source)
    end = time.monotonic() + args.seconds
    waited, warm_at = 0.0, 0.0
    last = time.perf_counter()
    for step, (x, y) in enumerate(source, 1):
        now = time.perf_counter()
        if step > 20:  # the truth: from the end of one iteration's body to the next one's start
            waited += now - last
        loss = F.cross_entropy(model(x.to(dev)), y.to(dev))
        opt.zero_grad()
        loss.backward()
        opt.step()
        last = time.perf_counter()
        if step == 20:
            warm_at = last
            print("warm", flush=True)
        elif step > 20 and step % 5 == 0:
            print(f"data share {waited / (last - warm_at):.3f}", flush=True)
        if time.monotonic() >= end:
            break


if __name__ == "__main__":
    main()
