"""Data-bound: CPU-heavy per-sample transforms and too few loader workers starve the model.

    python -m torchtop.demos.data_bound [--device auto|cpu|cuda] [--steps N] [--seconds S]

Every image goes through many blur-and-mix passes (a stand-in for JPEG decoding and heavy
augmentation) in a single DataLoader worker, while the model is small: the training thread
spends most of each step waiting in the DataLoader. torchtop should say data-loading, show the
lone worker near 100% CPU, and suggest more workers or cheaper transforms.
"""

from __future__ import annotations

import os

import torch

from torchtop.demos import common, data

CPU = common.Sizes(batch_size=64, width=16, workers=1)
CUDA = common.Sizes(batch_size=128, width=32, workers=1)


def main(argv: list[str] | None = None) -> int:
    args = common.build_parser(__doc__).parse_args(argv)
    device, stop = common.setup(args, CPU, CUDA)
    if device.type == "cpu":  # leave the worker its core: oversubscribed cores would hide the wait
        torch.set_num_threads(max(1, (os.cpu_count() or 1) - args.workers))
    dataset = data.SyntheticImages(seed=args.seed, augment_passes=40)
    loader = data.make_loader(dataset, args.batch_size, args.workers, device)
    model = common.SmallCNN(num_classes=dataset.num_classes, width=args.width).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    common.describe("data-bound", model, loader, device)
    return common.train(model, loader, optimizer, device, args, stop)


if __name__ == "__main__":
    common.run(main)
