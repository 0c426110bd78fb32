"""Memory leak: the loop keeps a tensor from every step, so memory in use grows without end.

    python -m torchtop.demos.memory_leak [--device auto|cpu|cuda] [--steps N] [--seconds S]

A classic: per-step outputs appended to a list "for later" (here a detached copy of the
logits and a slice of the input batch, ~1 MiB a step). On CUDA allocated memory climbs, on CPU
the process RSS does; torchtop should flag memory-leak with the growth it measured.
"""

from __future__ import annotations

from typing import Any

import torch

from torchtop.demos import common, data

KEEP_BYTES = 1 << 20  # what the loop forgets to let go of, every step


def main(argv: list[str] | None = None) -> int:
    args = common.build_parser(__doc__).parse_args(argv)
    device, stop = common.setup(args)
    dataset = data.SyntheticImages(seed=args.seed)
    loader = data.make_loader(dataset, args.batch_size, args.workers, device)
    model = common.SmallCNN(num_classes=dataset.num_classes, width=args.width).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    kept: list[Any] = []

    def after_step(step: int, loss: torch.Tensor) -> None:
        # "keep the predictions to compute an epoch metric later" - never cleared
        kept.append(torch.empty(KEEP_BYTES // 4, device=device).fill_(float(step)))

    common.describe("memory-leak", model, loader, device)
    return common.train(model, loader, optimizer, device, args, stop, after_step=after_step)


if __name__ == "__main__":
    common.run(main)
