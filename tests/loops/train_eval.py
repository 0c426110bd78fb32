"""Train, then evaluate, in turns: a loop with no torchtop in it (run it under `torchtop run` or
TORCHTOP=1). Each evaluation pass is 16 `no_grad` forwards over a held-out loader.

    python tests/loops/train_eval.py [--passes 15] [--train-batches 40] [--eval-batches 16]

Prints the evaluation forwards it made, so a test can compare them with `eval_steps`.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--passes", type=int, default=15)
    p.add_argument("--train-batches", type=int, default=40)
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--hold", type=float, default=0.0, help="seconds to stay alive at the end")
    args = p.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    train = DataLoader(
        TensorDataset(
            torch.randn(32 * args.train_batches, 64), torch.randint(0, 10, (32 * args.train_batches,))
        ),
        batch_size=32,
        shuffle=True,
    )
    held = DataLoader(
        TensorDataset(
            torch.randn(32 * args.eval_batches, 64), torch.randint(0, 10, (32 * args.eval_batches,))
        ),
        batch_size=32,
    )
    forwards = 0
    for _ in range(args.passes):
        model.train()
        for x, y in train:
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        correct = 0
        with torch.no_grad():
            for x, y in held:
                correct += int((model(x).argmax(1) == y).sum())
                forwards += 1
    print(f"eval forwards {forwards}", flush=True)
    if args.hold:
        import time

        time.sleep(args.hold)


if __name__ == "__main__":
    main()
