"""A torch.compile'd model fed by a DataLoader over a TensorDataset (no workers); no torchtop in it.

    TORCHTOP=1 python tests/loops/compiled.py [--seconds 600]

The loader's indexing costs about a millisecond a step, a few percent: a person calls the loop
compute bound and would not add worker processes for it. Prints "warm" once compiled and 20
steps on.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=600.0)
    args = p.parse_args()
    torch.manual_seed(0)
    model = torch.compile(
        nn.Sequential(nn.Linear(128, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(
        TensorDataset(torch.randn(16384, 128), torch.randint(0, 10, (16384,))), batch_size=128, shuffle=True
    )
    end, steps = time.monotonic() + args.seconds, 0
    while time.monotonic() < end:
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += 1
            if steps == 20:
                print("warm", flush=True)
            if time.monotonic() >= end:
                break


if __name__ == "__main__":
    main()
