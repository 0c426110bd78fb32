"""A healthy run: a small CNN on synthetic 32x32 images, cheap data, no bottleneck to find.

    python -m torchtop.demos.balanced [--device auto|cpu|cuda] [--steps N] [--seconds S] [--port P]

Loader workers make each batch well ahead of time, so the step is forward, backward and the
optimizer; torchtop should call it compute bound with a small data share and raise no alarm.
Batch 64 and a narrow model on CPU; batch 256 and a wider model on CUDA, which the CPU sizes
would leave mostly idle (see `common.CUDA_SIZES`).
"""

from __future__ import annotations

import torch

from torchtop.demos import common, data


def main(argv: list[str] | None = None) -> int:
    args = common.build_parser(__doc__).parse_args(argv)
    device, stop = common.setup(args)
    dataset = data.SyntheticImages(seed=args.seed)
    loader = data.make_loader(dataset, args.batch_size, args.workers, device)
    model = common.SmallCNN(num_classes=dataset.num_classes, width=args.width).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-4)
    common.describe("balanced", model, loader, device)
    return common.train(model, loader, optimizer, device, args, stop)


if __name__ == "__main__":
    common.run(main)
