"""An inference-only loop: `torch.no_grad()` forwards over a DataLoader, no backward, no
optimizer. No torchtop in it.

    TORCHTOP=1 python tests/loops/eval_only.py [--seconds 600] [--loader]

Prints "forwards N" every 20 forwards. Without --loader the batches are sliced from a tensor
(no data hook fires between forwards).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--loader", action="store_true")
    args = p.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    model.eval()
    xs = torch.randn(64 * 50, 256)
    batches = DataLoader(TensorDataset(xs), batch_size=64) if args.loader else None
    end = time.monotonic() + args.seconds
    n = 0
    with torch.no_grad():
        while time.monotonic() < end:
            for b in batches if batches is not None else xs.split(64):
                x = b[0] if isinstance(b, list) else b
                model(x).argmax(1)
                n += 1
                if n % 20 == 0:
                    print(f"forwards {n}", flush=True)
                if time.monotonic() >= end:
                    break


if __name__ == "__main__":
    main()
