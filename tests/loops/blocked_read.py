"""One process whose training thread blocks in a read: a stall, then a resume.

    python tests/loops/blocked_read.py --after 6 --block 20 --mark FILE

Trains a small MLP; after --after seconds of steps it reads one byte from a pipe that nobody
writes for --block seconds (then a timer thread does), first writing FILE (the test's clock
starts there), then trains on. The agent is on through torchtop.agent.start().
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def read_one(fd: int) -> bytes:
    return os.read(fd, 1)  # the stall: blocked until the timer writes


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--after", type=float, default=6.0)
    p.add_argument("--block", type=float, default=20.0)
    p.add_argument("--mark", default="")
    p.add_argument("--seconds", type=float, default=300.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    import torchtop.agent as ta

    ta.start()
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 64), torch.randn(32, 8)
    r, w = os.pipe()
    start = time.monotonic()
    blocked = False
    while time.monotonic() - start < args.seconds:
        if not blocked and time.monotonic() - start > args.after:
            blocked = True
            threading.Timer(args.block, os.write, (w, b"x")).start()
            if args.mark:
                Path(args.mark).write_text(str(time.time()))
            print("blocked", flush=True)
            read_one(r)
            print("resumed", flush=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        time.sleep(0.01)
    return 0


if __name__ == "__main__":
    sys.exit(main())
