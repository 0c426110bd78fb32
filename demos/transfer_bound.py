"""Transfer-bound (CUDA): big batches in pageable memory, copied synchronously every step.

    python -m torchtop.demos.transfer_bound [--device auto|cuda] [--steps N] [--seconds S]

Batches of 224x224 float32 images stay in ordinary (pageable) host memory and go to the GPU
with a plain `.to(device)`, while the model is light: the copies take most of the step.
torchtop should say transfer, show the pageable bytes, and suggest pin_memory + non_blocking
and sending uint8. There is no host-to-device copy without a GPU: on CPU the demo says so.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from torchtop.demos import common


class PrebuiltBatches(Dataset):
    """A few ready-made batches, served as they are: loading costs nothing, copying everything."""

    def __init__(self, batch_size: int, count: int = 4) -> None:
        g = torch.Generator().manual_seed(0)
        self.batches = [
            (
                torch.randn(batch_size, 3, 224, 224, generator=g),
                torch.randint(0, 10, (batch_size,), generator=g),
            )
            for _ in range(count)
        ]

    def __len__(self) -> int:
        return 1_000_000

    def __getitem__(self, index: int) -> Any:
        return self.batches[index % len(self.batches)]


def move_pageable(batch: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = batch
    return images.to(device), labels.to(device)  # synchronous copies from pageable memory


def main(argv: list[str] | None = None) -> int:
    args = common.build_parser(__doc__).parse_args(argv)
    common.require_cuda(
        args.device,
        "transfer-bound",
        "host-to-device copies only exist with a GPU (on CPU try --scenario data-bound)",
    )
    device, stop = common.setup(args, cuda=common.Sizes(batch_size=256, width=16, workers=0))
    loader = DataLoader(PrebuiltBatches(args.batch_size), batch_size=None, shuffle=False, num_workers=0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, args.width, 7, stride=4),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(args.width, 10),
    ).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    common.describe("transfer-bound", model, loader, device)
    return common.train(model, loader, optimizer, device, args, stop, move=move_pageable)


if __name__ == "__main__":
    common.run(main)
