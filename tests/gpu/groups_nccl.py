"""Tensor parallel and pipeline parallel on 2 GPUs (NCCL): the collective wait, by process group.

    torchrun --nproc_per_node 2 tests/gpu/groups_nccl.py --mode tp [--slow-rank 1]
    torchrun --nproc_per_node 2 tests/gpu/groups_nccl.py --mode pp [--slow-rank 1 | --heavy-rank 1 --blocks 3]

`tp`: an MLP split over a 1-D device mesh named tp (DTensor: ColwiseParallel then RowwiseParallel;
its all-reduce waits in `wait_tensor`). `pp`: the same MLP in two stages over a mesh named pp
(torch.distributed.pipelining, GPipe, 4 micro-batches; stage 1 waits for stage 0's activations
in recv, stage 0 for stage 1's gradients). With --slow-rank R that rank does extra matmuls in its
forward. Each rank runs torchtop's agent; rank 0 runs `torchtop report` and prints per rank: the
exposed collective wait (device where sampled), its split by group (host time of the named
collectives: on NCCL mostly enqueueing, see docs/multi-rank.md), the verdicts and the straggler.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("tp", "pp"), default="tp")
    p.add_argument("--slow-rank", type=int, default=None)
    p.add_argument(
        "--heavy-rank", type=int, default=None, help="pp: this stage holds --blocks blocks, the others one"
    )
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--extra", type=int, default=40)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--seconds", type=float, default=25.0)
    p.add_argument(
        "--window", type=int, default=0, help="then compare N steps' exposed wait with torch.profiler"
    )
    args = p.parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    import torchtop.agent as ta

    ta.start()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=(args.mode,))
    h, dev = args.hidden, torch.device("cuda", local)
    slow = rank == args.slow_rank
    mix = torch.randn(h, h, device=dev) / h**0.5

    def burn(x: torch.Tensor) -> torch.Tensor:
        if slow:
            with torch.no_grad():
                w = x.detach()
                for _ in range(args.extra):
                    w = torch.tanh(w @ mix)
            x = x + 0.0 * w
        return x

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(torch.relu(self.up(burn(x))))

    x = torch.randn(32, h, device=dev)
    if args.mode == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        model = parallelize_module(
            Block().to(dev), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()}
        )
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)

        def step() -> None:
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    else:
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        n = args.blocks if rank == args.heavy_rank else 1
        stage_mod = nn.Sequential(*(Block() for _ in range(n))).to(dev)
        stage = PipelineStage(stage_mod, rank, world, dev, group=mesh.get_group(args.mode))
        sched = ScheduleGPipe(stage, n_microbatches=4, loss_fn=lambda out, y: out.pow(2).mean())
        opt = torch.optim.SGD(stage_mod.parameters(), lr=1e-4)

        def step() -> None:
            if rank == 0:
                sched.step(x)
            elif rank == world - 1:
                sched.step(target=x)
            else:
                sched.step()
            opt.step()
            opt.zero_grad()

    for _ in range(20):
        step()
    torch.cuda.synchronize()
    proc = None
    if rank == 0:
        agent = ta.current()
        job = agent.identity.job_id if agent is not None else ""
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torchtop.monitor.commands.cli",
                "report",
                "--seconds",
                "10",
                "--job",
                job,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    end = time.monotonic() + args.seconds
    flag = torch.zeros(1, device=dev)
    while True:
        for _ in range(5):
            step()
        flag.fill_(1.0 if time.monotonic() > end or (proc is not None and proc.poll() is not None) else 0.0)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            break
    if proc is not None:
        out, err = proc.communicate(timeout=120)
        if proc.returncode != 0:
            print(f"torchtop report failed: {err[-2000:]}")
        else:
            r = json.loads(out)
            print(f"job verdict: {r['verdict']['kind']}: {r['verdict']['evidence'][:2]}")
            print(f"straggler: {json.dumps(r['straggler'])}")
            for e in r["ranks"]:
                print(
                    f"rank {e['rank']}: comm {e['comm_ms']:.2f} ms ({e['comm_source']}), by group "
                    f"{json.dumps(e['comm_by_group_ms'])}, device {json.dumps(e['device_ms'])}; "
                    f"verdict {e['verdict']['kind']}: {e['verdict']['evidence'][0]}"
                )
    ok = compare(step, rank, args.window, args.slow_rank) if args.window else True
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


def compare(step: Any, rank: int, window: int, slow_rank: int | None) -> bool:
    """Every step sampled for CUDA events, torch.profiler on `window` of them: this rank's exposed
    wait (torchtop's device comm) against the profiler's NCCL kernel time not overlapped by any
    other kernel, step by step (job_nccl.py's measure). True where the means agree within 10%
    (the slow rank, which waits least, is printed but not judged)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile, schedule

    import torchtop.agent as ta
    from tests.gpu.job_nccl import profiler_exposed_ms, torchtop_steps

    agent = ta.current()
    assert agent is not None
    agent.loop.resolver.stride = lambda current: 1  # keep 1: every step sampled
    agent.probe.phase_every = agent.probe.event_every = 1
    for _ in range(150):  # the stride and the sampling plan in force before run out first
        step()
    trace = Path(tempfile.mkdtemp(prefix="torchtop-groups-")) / f"rank{rank}.pt.trace.json.gz"
    prof = profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
        schedule=schedule(wait=0, warmup=0, active=window, repeat=1),
    )
    first = agent.probe.steps
    prof.start()
    for _ in range(window):
        step()
        prof.step()
    prof.stop()
    prof.export_chrome_trace(str(trace))
    torch.cuda.synchronize()
    for _ in range(10):  # the window's events resolve and ship meanwhile
        step()
    ours, theirs = torchtop_steps(agent, first, window), profiler_exposed_ms(trace)
    rows = [
        (ours[first + k]["comm"], theirs[k])
        for k in range(window)
        if "comm" in ours.get(first + k, {}) and k in theirs
    ]
    if not rows:
        print(f"rank {rank}: no step to compare (torchtop {len(ours)}, profiler {len(theirs)})", flush=True)
        return False
    mt, mp = sum(r[0] for r in rows) / len(rows), sum(r[1] for r in rows) / len(rows)
    rel = (mt - mp) / mp if mp else 0.0
    judged = rank != slow_rank
    print(
        f"rank {rank}: exposed wait over {len(rows)} steps: torchtop {mt:.3f} ms, profiler {mp:.3f} ms "
        f"({rel:+.1%}){'' if judged else ' (the slow rank: not judged)'}",
        flush=True,
    )
    return not judged or abs(rel) <= 0.10


if __name__ == "__main__":
    sys.exit(main())
