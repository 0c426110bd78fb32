"""An IterableDataset streamed through a DataLoader with one worker; no torchtop in it.

    TORCHTOP=1 python tests/loops/iterable_dataset.py [--seconds 600]

Records are made on the fly (a stand-in for reading shards) and cost little next to the model:
a person calls it compute bound. Prints "warm" after 20 steps.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, IterableDataset


class Records(IterableDataset):
    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(0)
        while True:
            x = torch.randn(64, generator=g)
            yield x, (x[:8].sum() > 0).long()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=600.0)
    args = p.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 2)
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = DataLoader(Records(), batch_size=64, num_workers=1, persistent_workers=True)
    end = time.monotonic() + args.seconds
    for step, (x, y) in enumerate(loader, 1):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 20:
            print("warm", flush=True)
        if time.monotonic() >= end:
            break


if __name__ == "__main__":
    main()
