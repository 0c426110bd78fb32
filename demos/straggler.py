"""Straggler: one rank of a torchrun job is slower than the others (its loader, forward, backward, or work).

    python -m torchtop.demos.straggler [--ranks N] [--parallel ddp|fsdp]
        [--slow data|forward|backward|work|none] [--slow-rank R]
    torchrun --nproc_per_node 4 -m torchtop.demos.straggler --parallel fsdp --slow forward

An MLP of --blocks blocks over sequences of --seq tokens, data parallel with DDP or FSDP2
(`fully_shard` per block; gloo on CPU, NCCL on CUDA). Run plainly, it starts itself under
torchrun with --ranks ranks. With `--slow data` the slow rank's loader reads from slower storage
(a sleep of --delay-ms per batch stands for it). With `--slow forward` / `--slow backward` the
slow rank does --extra more matmuls of real compute in its forward / backward (a slower GPU, a
thermal throttle) at the same work. With `--slow work` its batches are twice as long (2x --seq
tokens: uneven packing): it is slower because it does more. DDP's all-reduce spreads the delay
over the other ranks' backward; FSDP2's all-gathers and reduce-scatters over their forward and
backward. torchtop's job view should name the rank and the reason in every case.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, NamedTuple

import torch
from torch import nn

from torchtop.demos import common


def build_parser() -> argparse.ArgumentParser:
    p = common.build_parser(__doc__)
    p.add_argument("--ranks", type=int, default=None, help="ranks when run plainly (default: 4, or the GPUs)")
    p.add_argument("--parallel", default="ddp", choices=["ddp", "fsdp"], help="DDP or FSDP2 (fully_shard)")
    p.add_argument(
        "--slow", default="data", choices=["data", "forward", "backward", "work", "none"], help="what is slow"
    )
    p.add_argument("--slow-rank", type=int, default=None, help="which rank is slow (default: the last)")
    p.add_argument(
        "--delay-ms", type=float, default=40.0, help="--slow data: the slow loader's extra ms a batch"
    )
    p.add_argument(
        "--extra", type=int, default=12, help="--slow forward/backward: extra matmuls in its forward/backward"
    )
    p.add_argument(
        "--seq", type=int, default=8, help="tokens a sample (--slow work: twice as many on the slow rank)"
    )
    p.add_argument("--blocks", type=int, default=1, help="hidden blocks (each its own FSDP2 unit)")
    p.add_argument("--hidden", type=int, default=None, help="MLP width (default: 512 on CPU, 4096 on CUDA)")
    return p


class SlowBatches(torch.utils.data.IterableDataset):
    """Random batches; on the slow rank each one costs `delay_s` more (slow storage)."""

    def __init__(self, batch: int, seq: int, dim: int, classes: int, delay_s: float, seed: int) -> None:
        self.batch, self.seq, self.dim, self.classes = batch, seq, dim, classes
        self.delay_s, self.seed = delay_s, seed

    def __iter__(self) -> Any:
        g = torch.Generator().manual_seed(self.seed)
        while True:
            if self.delay_s > 0:
                time.sleep(self.delay_s)
            yield (
                torch.randn(self.batch, self.seq, self.dim, generator=g),
                torch.randint(0, self.classes, (self.batch, self.seq), generator=g),
            )


class _Extra(torch.autograd.Function):
    """Identity forward; `n` extra matmuls (real compute) on the gradient's way back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, n: int) -> torch.Tensor:
        ctx.save_for_backward(weight)
        ctx.n = n
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (weight,) = ctx.saved_tensors
        work = grad
        for _ in range(ctx.n):
            work = torch.tanh(work @ weight)
        return grad + 0.0 * work, None, None


class Net(nn.Module):
    """`blocks` hidden blocks; `extra` more matmuls in the backward, `extra_fwd` in the forward."""

    mix: torch.Tensor  # a buffer (register_buffer): Module's __getattr__ types it Tensor | Module

    def __init__(
        self, dim: int, hidden: int, classes: int, extra: int, extra_fwd: int = 0, blocks: int = 1
    ) -> None:
        super().__init__()
        self.embed = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU())
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()) for _ in range(blocks)
        )
        self.head = nn.Linear(hidden, classes)
        self.extra, self.extra_fwd = extra, extra_fwd
        self.register_buffer("mix", torch.randn(hidden, hidden) / hidden**0.5, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        if self.extra_fwd:  # forward-only work: nothing of it on the way back
            with torch.no_grad():
                work = h.detach()
                for _ in range(self.extra_fwd):
                    work = torch.tanh(work @ self.mix)
            h = h + 0.0 * work
        if self.extra:
            h = _Extra.apply(h, self.mix, self.extra)
        return self.head(h)


def relaunch(args: argparse.Namespace, argv: list[str]) -> int:
    """Not under a launcher: become `torchrun --standalone --nproc_per_node N -m this ...`."""
    nproc = args.ranks or (torch.cuda.device_count() if torch.cuda.is_available() else 0) or 4
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    os.execv(sys.executable, [*cmd, "-m", "torchtop.demos.straggler", *argv])
    return 0  # not reached


class Job(NamedTuple):
    """One rank's part of the demo job."""

    rank: int
    world: int
    slow_rank: int
    device: torch.device
    loader: torch.utils.data.DataLoader
    ddp: nn.Module  # the DDP-wrapped model, or the fully_shard-ed one
    optimizer: torch.optim.Optimizer


def setup_rank(args: argparse.Namespace) -> Job:
    """Device, agent, process group, the loader, model and optimizer of this rank (under torchrun)."""
    import torch.distributed as dist

    device = common.pick_device(args.device)
    local = int(os.environ.get("LOCAL_RANK", 0))
    if device.type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    common.start_agent(args.port + 2 * local if args.port else None)  # a pair of ports a rank
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    slow_rank = world - 1 if args.slow_rank is None else args.slow_rank
    slow = args.slow if rank == slow_rank else "none"
    hidden = args.hidden or (4096 if device.type == "cuda" else 512)
    batch = args.batch_size or (32 if device.type == "cuda" else 8)
    seq = args.seq * (2 if slow == "work" else 1)
    dim, classes = 256, 10
    delay = args.delay_ms / 1000 if slow == "data" else 0.0
    loader = torch.utils.data.DataLoader(
        SlowBatches(batch, seq, dim, classes, delay, args.seed + rank), batch_size=None, num_workers=0
    )
    model = Net(
        dim,
        hidden,
        classes,
        args.extra if slow == "backward" else 0,
        args.extra if slow == "forward" else 0,
        args.blocks,
    ).to(device)
    if args.parallel == "fsdp":
        ddp = shard(model, device, world)
    else:  # no buffers to broadcast in forward: the ranks meet only in backward's all-reduce
        ddp = nn.parallel.DistributedDataParallel(
            model, device_ids=[local] if device.type == "cuda" else None, broadcast_buffers=False
        )
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    return Job(rank, world, slow_rank, device, loader, ddp, optimizer)


def shard(model: Net, device: torch.device, world: int) -> nn.Module:
    """FSDP2: each block its own unit (an all-gather in forward, a reduce-scatter in backward),
    the root last, over a 1-D mesh named dp."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train_step(job: Job, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    x, y = x.to(job.device, non_blocking=True), y.to(job.device, non_blocking=True)
    loss = nn.functional.cross_entropy(job.ddp(x).flatten(0, 1), y.flatten())
    job.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    job.optimizer.step()
    return loss


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if "RANK" not in os.environ:
        return relaunch(args, argv)
    import torch.distributed as dist

    stop = common.StopFlag()
    stop.install()
    job = setup_rank(args)
    rank, device = job.rank, job.device
    if rank == 0:
        print(
            f"straggler demo: {job.world} ranks ({args.parallel}) on {device.type}, "
            f"rank {job.slow_rank} slow in {args.slow}",
            flush=True,
        )
    deadline = time.monotonic() + args.seconds if args.seconds else None
    log = common.LossLog(args.log_every if rank == 0 else 0, device)
    step = 0
    for x, y in job.loader:
        loss = train_step(job, x, y)
        step += 1
        log.add(step, loss)
        if args.steps is not None and step >= args.steps:
            break
        if step % 20 == 0:  # SIGTERM or --seconds on any rank stops every rank at the same step
            late = deadline is not None and time.monotonic() > deadline
            flag = torch.tensor([1.0 if (late or stop) else 0.0], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() > 0:
                break
    log.flush()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    common.run(main)
