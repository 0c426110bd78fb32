"""A data-parallel job under torchrun on CPU (gloo) where one rank stops inside its loop.

    torchrun --nproc_per_node 3 tests/loops/hang_job.py --hang-rank 1 --after 6 --hang 30 --mark FILE

Every rank trains a small MLP and all-reduces its gradients by hand each step. After --after
seconds of steps, rank --hang-rank sleeps --hang seconds at the top of its step (outside any
collective: the others wait in their all_reduce), first writing FILE (the test's clock starts
there), then trains on. The agent is on through torchtop.agent.start().
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


def stop_here(seconds: float) -> None:
    time.sleep(seconds)  # the hang: a blocking call outside any collective


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--hang-rank", type=int, default=1)
    p.add_argument("--after", type=float, default=6.0)
    p.add_argument("--hang", type=float, default=30.0)
    p.add_argument("--mark", default="")
    p.add_argument("--seconds", type=float, default=300.0)
    args = p.parse_args()
    torch.set_num_threads(1)  # the ranks share the machine's cores
    import torchtop.agent as ta

    ta.start()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 64), torch.randn(32, 8)
    start = time.monotonic()
    hung = False
    while time.monotonic() - start < args.seconds:
        if rank == args.hang_rank and not hung and time.monotonic() - start > args.after:
            hung = True
            if args.mark:
                Path(args.mark).write_text(str(time.time()))
            stop_here(args.hang)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        for q in model.parameters():
            dist.all_reduce(q.grad)
        opt.step()
        opt.zero_grad()
        time.sleep(0.01)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
