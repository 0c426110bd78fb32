"""A loop that updates its weights by hand, as pytorch/examples' word_language_model does
(`p.data.add_(p.grad, alpha=-lr)`): no optimizer, so no `optimizer.step()`. No torchtop in it.

    TORCHTOP=1 python tests/loops/manual_sgd.py [--seconds 600]

Prints "step N" every 10 steps.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn


class RNNModel(nn.Module):
    def __init__(self, ntoken: int = 200, nhid: int = 64) -> None:
        super().__init__()
        self.encoder = nn.Embedding(ntoken, nhid)
        self.rnn = nn.LSTM(nhid, nhid)
        self.decoder = nn.Linear(nhid, ntoken)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.encoder(x))
        return self.decoder(out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=600.0)
    args = p.parse_args()
    torch.manual_seed(0)
    model = RNNModel()
    criterion = nn.CrossEntropyLoss()
    data = torch.randint(0, 200, (35 * 400 + 1, 20))
    lr = 0.1
    end = time.monotonic() + args.seconds
    step = 0
    while time.monotonic() < end:
        for i in range(0, data.size(0) - 36, 35):
            x, y = data[i : i + 35], data[i + 1 : i + 36]
            model.zero_grad()
            out = model(x)
            loss = criterion(out.view(-1, 200), y.reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
            for prm in model.parameters():
                if prm.grad is not None:  # every parameter has one after backward
                    prm.data.add_(prm.grad, alpha=-lr)
            step += 1
            if step % 10 == 0:
                print(f"step {step}", flush=True)
            if time.monotonic() >= end:
                break


if __name__ == "__main__":
    main()
