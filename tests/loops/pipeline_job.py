"""A 2-stage (or N-stage) pipeline under torchrun on CPU (gloo): GPipe over micro-batches.

    torchrun --nproc_per_node 2 tests/loops/pipeline_job.py [--slow-rank 1] [--steps 200]

Each rank is one stage of an MLP (torch.distributed.pipelining: PipelineStage + ScheduleGPipe)
over a 1-D device mesh named pp; its send/recv waits are the pipeline bubble. With --slow-rank R
that stage does --extra more matmuls in its forward (a slower GPU); with --heavy-rank R it holds
--blocks blocks where the others hold one (a split by layers that is not by work). The agent is on through
torchtop.agent.start(); the test runs `torchtop report` beside it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--slow-rank", type=int, default=None)
    p.add_argument("--extra", type=int, default=30)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), default="gpipe")
    p.add_argument("--steps", type=int, default=100_000)  # the same on every rank: stages step together
    p.add_argument("--heavy-rank", type=int, default=None)  # this stage holds --blocks blocks, the others one
    p.add_argument("--blocks", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)  # the ranks share the machine's cores
    import torchtop.agent as ta

    ta.start()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    h = args.hidden
    slow = rank == args.slow_rank
    mix = torch.randn(h, h) / h**0.5

    class Block(nn.Module):
        """A pre-norm MLP block. The norm's weight makes even the first stage, whose input needs
        no gradient, compute `up`'s input gradient: every stage's backward does the same work (a
        bare Linear first would leave the first stage a matmul short, a real imbalance)."""

        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(h)
            self.up, self.down = nn.Linear(h, 2 * h), nn.Linear(2 * h, h)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if slow:  # real compute at the same work: a slower device
                with torch.no_grad():
                    w = x.detach()
                    for _ in range(args.extra):
                        w = torch.tanh(w @ mix)
                x = x + 0.0 * w
            return self.down(torch.relu(self.up(self.norm(x))))

    torch.manual_seed(rank)
    block: nn.Module = Block()
    if rank == args.heavy_rank:  # an unbalanced split: more layers on one stage
        block = nn.Sequential(block, *(Block() for _ in range(args.blocks - 1)))
    mb = torch.empty(8, h)  # static shapes: dynamic inference sends objects, which needs numpy
    stage = PipelineStage(
        block,
        rank,
        world,
        torch.device("cpu"),
        input_args=mb,
        output_args=mb,
        output_grads=mb,
        input_grads=mb,
        group=mesh.get_group("pp"),
    )
    kind = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
    sched = kind(stage, n_microbatches=args.micro, loss_fn=lambda out, y: (out - y).pow(2).mean())
    opt = torch.optim.SGD(block.parameters(), lr=1e-3)
    x = torch.randn(8 * args.micro, h)
    t0 = time.monotonic()
    for _ in range(args.steps):
        if rank == 0:
            sched.step(x)
        elif rank == world - 1:
            sched.step(target=x)
        else:
            sched.step()
        opt.step()
        opt.zero_grad()
    if rank == 0:
        print(f"{args.steps} steps in {time.monotonic() - t0:.1f} s", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
