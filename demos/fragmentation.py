"""Fragmentation (CUDA): odd sizes come and go in a tight budget: the allocator's holes go unused.

Every step has a different sequence length, and a cache of tensors of odd sizes comes and goes:
the caching allocator splits its segments into holes it cannot reuse.

    python -m torchtop.demos.fragmentation [--device auto|cuda] [--steps N] [--seconds S]

A token MLP over variable-length batches, plus a rolling cache of 4-240 MiB tensors released in
random order (what KV caches and variable-resolution pipelines do), in a 4 GiB budget (as when
a big model already fills the card: `set_per_process_memory_fraction`). The live set fits the
budget, but the holes between live blocks do not serve new sizes, so the allocator keeps hitting
the cap, flushing its cache and retrying. torchtop should flag fragmentation (retries while
memory sits free in the cache) and suggest expandable_segments. Only CUDA's caching allocator
fragments like this: on CPU the demo says so.
"""

from __future__ import annotations

import os
import random
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from torchtop.demos import common

MIB = 1 << 20
BUDGET = 4 << 30  # the share of the card this job may use
KEEP = int(os.environ.get("FRAG_KEEP", "20"))  # tensors the rolling cache holds (62-124 MiB each)
GROW_STEPS = 1500


class VariableLength(Dataset):
    """Batches of (tokens x 512) features with a different token count each time (sliced from a
    pool made once, so loading is cheap and the allocator is what this demo is about)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        g = torch.Generator().manual_seed(seed)
        self.pool = torch.randn(8192, 512, generator=g)
        self.labels = torch.randint(0, 10, (8192,), generator=g)

    def __len__(self) -> int:
        return 1_000_000

    def __getitem__(self, index: int) -> Any:
        tokens = random.Random(self.seed * 7919 + index).choice(range(512, 8192, 136))
        return self.pool[:tokens], self.labels[:tokens]


def main(argv: list[str] | None = None) -> int:
    args = common.build_parser(__doc__).parse_args(argv)
    common.require_cuda(
        args.device,
        "fragmentation",
        "it is the CUDA caching allocator's problem (on CPU try --scenario memory-leak)",
    )
    device, stop = common.setup(args, cuda=common.Sizes(batch_size=1, width=2048, workers=2))
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, BUDGET / total), torch.cuda.current_device())
    loader = DataLoader(
        VariableLength(args.seed),
        batch_size=None,
        shuffle=False,
        num_workers=args.workers,
        pin_memory=True,
        persistent_workers=True,
    )
    model = nn.Sequential(
        nn.Linear(512, args.width),
        nn.GELU(),
        nn.Linear(args.width, args.width),
        nn.GELU(),
        nn.Linear(args.width, 10),
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng = random.Random(args.seed)
    cache: list[torch.Tensor] = []

    def after_step(step: int, loss: torch.Tensor) -> None:
        # sizes drift up and start over every GROW_STEPS (a sequence-length curriculum, a growing
        # cache): new sizes keep missing the holes the old ones left
        scale = 1.0 + (step % GROW_STEPS) / GROW_STEPS
        size = int(rng.randint(4, 120) * MIB * scale) + rng.randint(1, 999) * 4096
        try:
            cache.append(torch.empty(size, dtype=torch.uint8, device=device))
        except torch.OutOfMemoryError:
            del cache[: len(cache) // 2]  # what a cache does under pressure: evict
        if step % 100 == 0:
            stats = torch.cuda.memory_stats(device)
            print(
                f"step {step}: {len(cache)} cached tensors, reserved {stats['reserved_bytes.all.current'] >> 20} MiB, "
                f"allocator retries {stats['num_alloc_retries']}",
                flush=True,
            )
        if torch.cuda.memory_allocated(device) > 0.8 * BUDGET:
            del cache[: len(cache) // 2]  # live data near the budget: shed load before the step OOMs
        while len(cache) > KEEP:
            cache.pop(rng.randrange(len(cache)))  # released in random order: holes everywhere

    common.describe("fragmentation", model, loader, device)
    return common.train(model, loader, optimizer, device, args, stop, after_step=after_step)


if __name__ == "__main__":
    common.run(main)
