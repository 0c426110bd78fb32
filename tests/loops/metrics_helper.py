"""A loop whose step spends most of its time in a metrics helper of the user's (several lines
of per-class statistics on the host, in Python, tens of milliseconds a call). No torchtop in it.

    TORCHTOP=1 python tests/loops/metrics_helper.py [--seconds 600]

Prints "warm" after 20 steps.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn


def compute_metrics(logits: torch.Tensor, y: torch.Tensor, rounds: int) -> dict[str, float]:
    pred = logits.argmax(1).tolist() * rounds
    truth = y.tolist() * rounds
    out: dict[str, float] = {}
    for c in range(10):
        tp = sum(1 for p, t in zip(pred, truth) if p == c and t == c)
        fp = sum(1 for p, t in zip(pred, truth) if p == c and t != c)
        fn = sum(1 for p, t in zip(pred, truth) if p != c and t == c)
        out[f"f1_{c}"] = 2 * tp / max(1, 2 * tp + fp + fn)
    scores = sorted(out.values())
    out["median_f1"] = scores[len(scores) // 2]
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--repeat", type=int, default=120, help="how many times over the batch (its cost)")
    args = p.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    xs, ys = torch.randn(2048, 64), torch.randint(0, 10, (2048,))
    end = time.monotonic() + args.seconds
    step = 0
    while time.monotonic() < end:
        for i in range(0, 2048, 256):
            x, y = xs[i : i + 256], ys[i : i + 256]
            logits = model(x)
            loss = nn.functional.cross_entropy(logits, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            compute_metrics(logits.detach(), y, args.repeat)
            step += 1
            if step == 20:
                print("warm", flush=True)


if __name__ == "__main__":
    main()
