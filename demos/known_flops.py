"""Known FLOPs: a chain of large bf16 matmuls whose FLOPs a step are known in closed form (MFU).

    python -m torchtop.demos.known_flops [--device auto|cpu|cuda] [--steps N] [--seconds S]

`depth` bias-free linear layers of `width` on a batch of `batch_size` rows: each step is
2·B·W²·depth FLOPs forward, as many for the weights' gradients and 2·B·W²·(depth - 1) for the
inputs' (the batch itself needs none). The demo prints that figure; torchtop counts the FLOPs
of one step itself and shows the achieved TFLOP/s and the MFU against the GPU's bf16 peak. On
an H100 this is a compute-bound job near the top of what the GPU does; on CPU (float32, small)
the count is the same formula.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from torchtop.demos import common

CPU = common.Sizes(batch_size=256, width=256, workers=0)
CUDA = common.Sizes(batch_size=8192, width=8192, workers=0)
DEPTH = 8


class MatmulChain(nn.Module):
    """Nothing but matmuls: bias-free linear layers, no activations."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def flops_per_step(batch: int, width: int, depth: int) -> int:
    """Forward, weight gradients, input gradients (none for the batch itself)."""
    mm = 2 * batch * width * width
    return mm * depth + mm * depth + mm * (depth - 1)


def build(device: torch.device, batch: int, width: int, depth: int = DEPTH) -> tuple[nn.Module, torch.Tensor]:
    """The model and a batch, bf16 on CUDA and float32 on CPU."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = MatmulChain(width, depth).to(device=device, dtype=dtype)
    for layer in model.layers:  # keep activations near unit scale through the chain
        if isinstance(layer, nn.Linear):  # all of them: says so to the type checker
            nn.init.normal_(layer.weight, std=width**-0.5)
    return model, torch.randn(batch, width, device=device, dtype=dtype)


def step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    loss = model(x).float().square().mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def main(argv: list[str] | None = None) -> int:
    args = common.build_parser(__doc__).parse_args(argv)
    device, stop = common.setup(args, CPU, CUDA)
    if device.type == "cpu":
        torch.set_num_threads(1)  # the same work on a shared machine, without threads fighting
    model, x = build(device, args.batch_size, args.width)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    flops = flops_per_step(args.batch_size, args.width, DEPTH)
    print(
        f"known-flops demo on {device.type}: {DEPTH} x {args.width}² matmuls, batch {args.batch_size}, "
        f"{x.dtype}; {flops / 1e12:.3f} TFLOP a step",
        flush=True,
    )
    deadline = None if args.seconds is None else time.monotonic() + args.seconds
    n = 0
    progress = common.Progress(args.log_every)
    while not stop:
        step(model, optimizer, x)
        n += 1
        progress.step(n)
        if (args.steps is not None and n >= args.steps) or (deadline and time.monotonic() >= deadline):
            break
    print(f"stopped after {n} steps", flush=True)
    return 0


if __name__ == "__main__":
    common.run(main)
