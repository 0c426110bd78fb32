"""A GPU-bound loop that reads its loss back every step (`loss.item()`); no torchtop in it.

    TORCHTOP=1 python tests/loops/gpu_item_sync.py [--seconds 600]

Large matmuls keep the GPU busy; the host queues a step's kernels in a fraction of it and then
waits in `.item()`, outside the measured phases. A person calls it compute (GPU) bound: the host's
`other` time is it waiting on the GPU, not work of its own. Needs CUDA. Prints "warm" after 20
steps.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--width", type=int, default=8192)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gpu_item_sync needs CUDA", file=sys.stderr)
        sys.exit(2)
    torch.manual_seed(0)
    dev = torch.device("cuda")
    w = args.width
    model = nn.Sequential(nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, 10)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(2048, w, device=dev), torch.randint(0, 10, (2048,), device=dev)
    end, step = time.monotonic() + args.seconds, 0
    while time.monotonic() < end:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        total = loss.item()  # the host waits here for the step's kernels
        step += 1
        if step == 20:
            print("warm", flush=True)
        if step % 50 == 0:
            print(f"step {step} loss {total:.4f}", flush=True)


if __name__ == "__main__":
    main()
