"""Compute-bound: a wide network on cheap, well-prefetched data: the healthy case.

    python -m torchtop.demos.compute_bound [--device auto|cpu|cuda] [--steps N] [--seconds S]

Forward, backward and the optimizer fill the step; the loader keeps batches ready ahead of time.
torchtop should say compute (no warning) and point at ways to make the math itself cheaper:
mixed precision, torch.compile, a fused optimizer.
"""

from __future__ import annotations

import torch

from torchtop.demos import common, data

CPU = common.Sizes(batch_size=64, width=48, worker_cap=1)
CUDA = common.Sizes(batch_size=512, width=512, worker_cap=8)


def main(argv: list[str] | None = None) -> int:
    args = common.build_parser(__doc__).parse_args(argv)
    device, stop = common.setup(args, CPU, CUDA)
    dataset = data.SyntheticImages(seed=args.seed)
    loader = data.make_loader(dataset, args.batch_size, args.workers, device, prefetch_factor=4)
    model = common.SmallCNN(num_classes=dataset.num_classes, width=args.width).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    common.describe("compute-bound", model, loader, device)
    return common.train(model, loader, optimizer, device, args, stop)


if __name__ == "__main__":
    common.run(main)
