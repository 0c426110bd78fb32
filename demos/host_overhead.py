"""Host overhead (CUDA): a deep, narrow net on tiny batches: the GPU waits on Python and launches.

Thousands of microsecond kernels a step: Python and kernel launches set the pace while the GPU
idles between them.

    python -m torchtop.demos.host_overhead [--device auto|cuda] [--steps N] [--seconds S]

No data wait, no big copies, and still a slow step: torchtop should say host-overhead (GPU busy
well under half the time) and suggest torch.compile / CUDA graphs and bigger batches. It is a
GPU problem: on CPU the demo says so.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from torchtop.demos import common

DEPTH = 48


class Vectors(Dataset):
    def __init__(self, width: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(4096, width, generator=g)
        self.y = torch.randint(0, 10, (4096,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Any:
        return self.x[i], self.y[i]


def main(argv: list[str] | None = None) -> int:
    args = common.build_parser(__doc__).parse_args(argv)
    common.require_cuda(
        args.device,
        "host-overhead",
        "it is the GPU waiting on the host (on CPU try --scenario compute-bound)",
    )
    device, stop = common.setup(args, cuda=common.Sizes(batch_size=16, width=64, workers=0))
    layers: list[nn.Module] = []
    for _ in range(DEPTH):
        layers += [nn.Linear(args.width, args.width), nn.LayerNorm(args.width), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(args.width, 10)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)  # one kernel per tensor
    loader = DataLoader(
        Vectors(args.width), batch_size=args.batch_size, shuffle=True, drop_last=True, pin_memory=True
    )
    common.describe("host-overhead", model, loader, device)
    return common.train(model, loader, optimizer, device, args, stop)


if __name__ == "__main__":
    common.run(main)
