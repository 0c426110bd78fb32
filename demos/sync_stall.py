"""Sync stall: `loss.item()` printed every step makes the host wait for the GPU, then the GPU waits.

    python -m torchtop.demos.sync_stall [--device auto|cpu|cuda] [--steps N] [--seconds S]

Each step builds its batch on the host in Python, queues a deep stack of large matmuls on the
GPU, and prints the loss: `loss.item()` blocks until the GPU has done all of that work, and
while the host then builds the next batch the GPU has nothing queued. On CUDA torchtop should
say sync and name the `.item()` call's line in this file, with the wait a step and what not
waiting would buy. On CPU nothing waits (`.item()` reads a value already computed): the print
is ordinary host work there, and torchtop says no sync.
"""

from __future__ import annotations

import random
import time

import torch
from torch import nn

from torchtop.demos import common

FEATURES = 256
CPU = common.Sizes(batch_size=32, width=128, workers=0)
CUDA = common.Sizes(batch_size=512, width=4096, workers=0)
DEPTH = 8


def make_batch(batch: int, rows: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch assembled on the host, partly in Python (as a tokenizer or a sampler would)."""
    picks = [random.randrange(FEATURES) for _ in range(batch * rows // 8)]
    x = torch.randn(batch, FEATURES)
    x[:, 0] = torch.tensor(picks[:batch], dtype=torch.float32) / FEATURES
    return x, torch.randint(0, 10, (batch,))


def main(argv: list[str] | None = None) -> int:
    args = common.build_parser(__doc__).parse_args(argv)
    device, stop = common.setup(args, CPU, CUDA)
    if device.type == "cpu":
        torch.set_num_threads(1)  # a small model: more threads only fight over a shared machine
    layers: list[nn.Module] = [nn.Linear(FEATURES, args.width)]
    for _ in range(DEPTH):
        layers += [nn.GELU(), nn.Linear(args.width, args.width)]
    model = nn.Sequential(*layers, nn.GELU(), nn.Linear(args.width, 10)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    n = sum(p.numel() for p in model.parameters())
    print(
        f"sync-stall demo on {device.type}: MLP {n / 1e6:.1f} M params, batch {args.batch_size}", flush=True
    )
    deadline = None if args.seconds is None else time.monotonic() + args.seconds
    step = 0
    while not stop:
        x, y = make_batch(args.batch_size)
        x, y = x.to(device), y.to(device)
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        print(f"step {step} loss {loss.item():.4f}", flush=True)  # the sync: waits for the step's GPU work
        if (args.steps is not None and step >= args.steps) or (deadline and time.monotonic() >= deadline):
            break
    print(f"stopped after {step} steps", flush=True)
    return 0


if __name__ == "__main__":
    common.run(main)
