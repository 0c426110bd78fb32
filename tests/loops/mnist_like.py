"""pytorch/examples' MNIST, its dataset swapped for random tensors; no torchtop in it.

    TORCHTOP=1 python tests/loops/mnist_like.py [--seconds 600]

The model, optimizer, schedule, loaders and train/test loops are the example's (CPU: no loader
workers, as there); a person calls it compute bound. Prints "warm" after 20 steps.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn, optim
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--batch-size", type=int, default=64)
    args = p.parse_args()
    torch.manual_seed(1)
    train = TensorDataset(torch.randn(6400, 1, 28, 28), torch.randint(0, 10, (6400,)))
    test = TensorDataset(torch.randn(1000, 1, 28, 28), torch.randint(0, 10, (1000,)))
    train_loader = DataLoader(train, batch_size=args.batch_size, shuffle=True)
    test_loader = DataLoader(test, batch_size=1000)
    model = Net()
    optimizer = optim.Adadelta(model.parameters(), lr=1.0)
    scheduler = StepLR(optimizer, step_size=1, gamma=0.7)
    end, steps = time.monotonic() + args.seconds, 0
    while time.monotonic() < end:
        model.train()
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
            steps += 1
            if steps == 20:
                print("warm", flush=True)
            if batch_idx % 10 == 0:
                print(f"step {steps} loss {loss.item():.4f}", flush=True)
            if time.monotonic() >= end:
                break
        model.eval()
        correct = 0
        with torch.no_grad():
            for data, target in test_loader:
                correct += model(data).argmax(dim=1).eq(target).sum().item()
        scheduler.step()


if __name__ == "__main__":
    main()
