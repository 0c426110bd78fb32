"""A loop with slow steps (resnet18 on a CPU takes 3-13 s a step): here a model whose forward
sleeps, so the step time is known. No torchtop in it.

    TORCHTOP=1 python tests/loops/slow_steps.py [--step-s 3] [--seconds 600]

Prints "step N" after each step.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn


class Slow(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.net = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)  # stands for seconds of convolutions
        return self.net(x)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--step-s", type=float, default=3.0)
    p.add_argument("--seconds", type=float, default=600.0)
    args = p.parse_args()
    model = Slow(args.step_s)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    end = time.monotonic() + args.seconds
    step = 0
    while time.monotonic() < end:
        x, y = torch.randn(8, 32), torch.randint(0, 4, (8,))
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        print(f"step {step}", flush=True)


if __name__ == "__main__":
    main()
