"""Mixed precision: one model in FP32 or under autocast (bf16, or fp16 with loss scaling), to compare.

    python -m torchtop.demos.mixed_precision --precision fp32|bf16|fp16 [--device auto|cpu|cuda]
    torchtop compare --demo amp        # both, recorded, then side by side

A deep MLP on large batches (activations dominate its memory): under autocast the matmuls run
in 16-bit and the activations kept for backward take half the bytes, so the step is faster and
the memory peak lower, where the hardware has 16-bit matmuls (CUDA tensor cores; CPUs with
AVX512-BF16 or AMX). The data is made on the device once: the step is the model's work alone.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from torchtop.demos import common

CPU = common.Sizes(batch_size=2048, width=256, workers=0)
CUDA = common.Sizes(batch_size=4096, width=4096, workers=0)
DEPTH = 8
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def mlp(width: int, depth: int, classes: int = 10) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


def main(argv: list[str] | None = None) -> int:
    parser = common.build_parser(__doc__)
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="bf16")
    args = parser.parse_args(argv)
    device, stop = common.setup(args, CPU, CUDA)
    if args.precision == "fp16" and device.type == "cpu":
        raise common.DemoError("fp16 autocast is for CUDA; on CPU use --precision bf16")
    if device.type == "cpu":  # one thread: the two runs compare precisions, not thread pools on a busy host
        torch.set_num_threads(1)
    model = mlp(args.width, DEPTH).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator(device=device).manual_seed(args.seed)
    batches = [
        (
            torch.randn(args.batch_size, args.width, device=device, generator=g),
            torch.randint(0, 10, (args.batch_size,), device=device, generator=g),
        )
        for _ in range(4)
    ]
    amp = args.precision != "fp32"
    dtype = DTYPES.get(args.precision, torch.float32)
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")
    print(
        f"mixed-precision demo on {device.type}: {args.precision}, MLP {DEPTH}x{args.width}, "
        f"{common.count_parameters(model) / 1e6:.2f} M params, batch {args.batch_size}, torch {torch.__version__}",
        flush=True,
    )
    log = common.LossLog(args.log_every, device)
    limit = common.RunLimit(args)
    step = 0
    for x, y in itertools.cycle(batches):
        with torch.autocast(device.type, dtype=dtype, enabled=amp):
            out = model(x)
        loss = nn.functional.cross_entropy(out.float(), y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        step += 1
        log.add(step, loss.detach())
        if stop or limit.reached(step):
            break
    log.flush()
    limit.report(step, device)
    return 0


if __name__ == "__main__":
    common.run(main)
