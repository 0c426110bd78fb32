"""Gradient accumulation (4 micro-batches a step) under CPU bfloat16 autocast; no torchtop in it.

    TORCHTOP=1 python tests/loops/grad_accum_autocast.py [--seconds 600]

A DataLoader over in-memory tensors, no workers: a few percent of data wait, which a person does
not call a bottleneck. Prints "warm" after 20 optimizer steps.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ACCUMULATE = 4


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=600.0)
    args = p.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 10)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(
        TensorDataset(torch.randn(8192, 256), torch.randint(0, 10, (8192,))), batch_size=64, shuffle=True
    )
    end, steps = time.monotonic() + args.seconds, 0
    while time.monotonic() < end:
        for i, (x, y) in enumerate(loader):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y) / ACCUMULATE
            loss.backward()
            if (i + 1) % ACCUMULATE == 0:
                opt.step()
                opt.zero_grad(set_to_none=True)
                steps += 1
                if steps == 20:
                    print("warm", flush=True)
            if time.monotonic() >= end:
                break


if __name__ == "__main__":
    main()
