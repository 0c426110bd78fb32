"""A 2-rank NCCL job where rank 1 stops before an all-reduce: the hung rank and the collective's
sequence number named from torch's flight recorder within 15 s (issue 38, item 1, GPU).

    python tests/gpu/hang_check.py [--hang 60]
    python tests/gpu/hang_check.py --backend gloo    # the same on CPU: the script's own check

Starts `torchrun --nproc_per_node 2` on this file (--worker): every rank trains a small MLP on its
GPU, all-reduces its flattened gradients by hand and reads its loss (`.item()`: the host waits for
the GPU there, outside any collective frame); after --after seconds rank 1 sleeps --hang seconds
between its backward and its all-reduce. Once it stops, `torchtop report` runs a few seconds at a
time until one says `stalled` (a separate process, as a user would), and the verdict is printed.
Exit code 0 when it is said within 15 s of the stop, names rank 1 as holding the job and rank 0 as
waiting in an all_reduce by its sequence number ("rank 0 waits in all_reduce #N"), else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 15.0


def stop_here(seconds: float) -> None:
    time.sleep(seconds)  # the hang: rank 1 never enters the next all-reduce


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch import nn

    sys.path.insert(0, str(ROOT))
    import torchtop.agent as ta

    ta.start()  # before the process group: the flight recorder's buffer is set for it
    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    dev = torch.device("cpu")
    if args.backend == "nccl":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
    else:
        torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(256, 1024, device=dev), torch.randn(256, 1024, device=dev)
    start, hung = time.monotonic(), False
    while time.monotonic() - start < args.seconds:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if rank == 1 and not hung and time.monotonic() - start > args.after:
            hung = True
            Path(args.mark).write_text(str(time.time()))
            stop_here(args.hang)
        flat = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        dist.all_reduce(flat)
        opt.step()
        opt.zero_grad()
        loss.item()  # the waiting rank blocks here, in the GPU's wait, not in a collective frame
    dist.destroy_process_group()
    return 0


def report(seconds: float) -> dict[str, Any] | None:
    cmd = [sys.executable, "-m", "torchtop.monitor.commands.cli", "report", "--seconds", str(seconds)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 120)
    if proc.returncode != 0:
        print(f"torchtop report failed: {proc.stderr[-2000:]}", flush=True)
        return None
    return json.loads(proc.stdout)


def judge(verdict: dict[str, Any]) -> list[str]:
    """What the verdict misses ([] when it names the hung rank and the sequence number in time)."""
    ev: list[str] = verdict.get("evidence", [])
    missing = []
    if verdict.get("kind") != "stalled":
        missing.append(f"the verdict is {verdict.get('kind')!r}, not 'stalled'")
    m = re.match(r"no step end (?:on any rank )?for (\d+) s", ev[0] if ev else "")
    if m is None or int(m.group(1)) > DEADLINE_S:
        missing.append(f"not said within {DEADLINE_S:.0f} s of the stop")
    if not any(re.match(r"rank 1 (is in .*outside any collective|never entered )", e) for e in ev):
        missing.append("rank 1 is not named as holding the job")
    if not any(re.match(r"rank 0 waits in \w+ #\d+", e) for e in ev):
        missing.append("rank 0 is not said to wait in a collective by its sequence number")
    return missing


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--after", type=float, default=8.0)
    p.add_argument("--hang", type=float, default=60.0)
    p.add_argument("--seconds", type=float, default=300.0)
    p.add_argument("--mark", default="")
    p.add_argument("--backend", default="nccl")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    tmp = Path(tempfile.mkdtemp(prefix="hang-check-"))
    mark = tmp / "stopped"
    env = dict(
        os.environ, TORCHTOP_QUIET="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    )
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
        "--worker", "--after", str(args.after), "--hang", str(args.hang), "--mark", str(mark),
        "--backend", args.backend,
    ]  # fmt: skip
    log = (tmp / "job.log").open("wb")
    job = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not mark.exists():
            if job.poll() is not None or time.monotonic() > deadline:
                print("the job never stopped:\n" + (tmp / "job.log").read_text()[-3000:])
                return 1
            time.sleep(0.1)
        stop = time.monotonic()
        verdict: dict[str, Any] = {}
        while time.monotonic() - stop < args.hang - 5:
            r = report(3.0)
            verdict = r["verdict"] if r is not None else {}
            if verdict.get("kind") == "stalled":
                break
        print(json.dumps(verdict, indent=1))
        missing = judge(verdict)
        for line in missing:
            print(f"FAIL: {line}")
        if not missing:
            print("OK: the hung rank and the collective's sequence number are named")
        return 1 if missing else 0
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGTERM)
            try:
                job.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
        log.close()


if __name__ == "__main__":
    sys.exit(main())
