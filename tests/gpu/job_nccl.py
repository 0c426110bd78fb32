"""NCCL DDP on 2+ GPUs with one rank slowed: torchtop's straggler verdict and exposed collective
wait against torch.profiler, step by step.

    torchrun --nproc_per_node 2 tests/gpu/job_nccl.py --slow data
    torchrun --nproc_per_node 2 tests/gpu/job_nccl.py --slow backward
    torchrun --nproc_per_node 2 tests/gpu/job_nccl.py --parallel fsdp --blocks 4 --slow forward
    torchrun --nproc_per_node 2 tests/gpu/job_nccl.py --parallel fsdp --blocks 4 --slow backward
    torchrun --nproc_per_node 2 tests/gpu/job_nccl.py --parallel fsdp --blocks 4 --slow work --seq 64

Each rank runs the straggler demo's DDP job (demos/straggler.py: an MLP, NCCL, the last rank slow
in its loader or in its backward compute) with torchtop's agent. Rank 0 asks for a job report
(`torchtop report`, a separate process, as a user would) and prints the verdict. Then every rank
samples CUDA events on every step for a window of steps that torch.profiler also records, and
compares, step by step, torchtop's exposed collective wait (the compute stream's time from the
end of backward's compute to the end of the backward, where DDP waits for its all-reduce) with the
profiler's: NCCL kernel time not overlapped by any other kernel, for the kernels launched in
that step. The goal: the means agree within 10% on the ranks that wait. Exit code 0 when the
verdict names the slow rank and reason and the waiting ranks agree, else 1.

The paired overhead figure on this job comes from tests/benchmarks/bench_paired.py --ddp (the
same DDP, no slowdown, every rank swapping the wrappers at the same steps).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from torchtop.agent.capture.trace_summary import _length, _subtract, _union  # noqa: E402
from torchtop.demos import straggler  # noqa: E402

WINDOW = 30  # steps compared


def parser() -> argparse.ArgumentParser:
    p = straggler.build_parser()
    p.set_defaults(device="cuda", delay_ms=40.0, extra=48)
    p.add_argument("--report-seconds", type=float, default=8.0)
    p.add_argument("--window", type=int, default=WINDOW, help="steps compared with the profiler")
    p.add_argument("--keep", default=None, help="a folder: keep each rank's trace and torchtop's steps there")
    return p


# -- the profiler's view ---------------------------------------------------------------------------
def profiler_exposed_ms(trace: Path) -> dict[int, float]:
    """ProfilerStep number -> NCCL kernel time (ms) not overlapped by any other GPU kernel or
    copy, over the kernels launched (on any thread) within that step's host span."""
    with gzip.open(trace, "rt") as fh:
        events = json.load(fh)["traceEvents"]
    steps = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e["dur"]), int(e["name"].split("#")[1]))
        for e in events
        if e.get("ph") == "X"
        and str(e.get("name", "")).startswith("ProfilerStep#")
        and e.get("cat") != "gpu_user_annotation"
    )
    launch_ts = {
        e["args"]["correlation"]: float(e["ts"])
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") in ("cuda_runtime", "cuda_driver")
        and "correlation" in e.get("args", {})
    }
    per: dict[int, tuple[list, list]] = {n: ([], []) for _, _, n in steps}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        launched = launch_ts.get(e.get("args", {}).get("correlation"))
        if launched is None:
            continue
        step = next((n for s, t, n in steps if s <= launched <= t), None)
        if step is None:
            continue
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        is_comm = e.get("cat") == "kernel" and "nccl" in str(e.get("name", "")).lower()
        per[step][0 if is_comm else 1].append(span)
    return {
        n: _length(_subtract(_union(comm), _union(other))) / 1000.0
        for n, (comm, other) in per.items()
        if comm
    }


# -- torchtop's view -------------------------------------------------------------------------------
def torchtop_steps(agent: Any, first: int, n: int) -> dict[int, dict[str, float]]:
    """Step index -> device ms (comm, backward, step) of this rank's steps first..first+n-1."""
    from torchtop.monitor.link.client import AgentClient
    from torchtop.monitor.link.targets import from_discovery

    client = AgentClient(from_discovery(agent.discovery_info()))
    try:
        deadline = time.monotonic() + 30
        while True:
            _reply, steps = client.snapshot(timeout=10.0)
            got = {s.i: s.device_ms for s in steps if first <= s.i < first + n and s.device_ms}
            if len(got) >= n or time.monotonic() > deadline:
                return got
            time.sleep(0.5)
    finally:
        client.close()


def run_report(seconds: float, job_id: str, out: dict[str, Any]) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchtop.monitor.commands.cli",
            "report",
            "--seconds",
            str(seconds),
            "--job",
            job_id,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    out["code"], out["stderr"] = proc.returncode, proc.stderr
    out["report"] = json.loads(proc.stdout) if proc.returncode == 0 else None


def main() -> int:
    args = parser().parse_args()
    os.environ.setdefault("TORCHTOP_QUIET", "1")
    job = straggler.setup_rank(args)
    import torchtop.agent as ta

    agent = ta.current()
    assert agent is not None
    rank = job.rank
    it = iter(job.loader)
    flag = torch.zeros(1, device=job.device)

    def steps(n: int) -> None:
        for _ in range(n):
            straggler.train_step(job, *next(it))

    steps(40)  # warm-up: cuDNN/cuBLAS, the allocator, DDP's first iterations
    t = time.perf_counter()
    steps(20)
    print(
        f"rank {rank}: {20 / (time.perf_counter() - t):.1f} steps/s after the warm-up; the agent cut "
        f"{agent.probe.steps} steps, hook failures {agent.probe.failures}, loop errors {agent.loop.errors}",
        flush=True,
    )
    # 1. the verdict: rank 0 runs `torchtop report` while every rank trains
    found: dict[str, Any] = {}
    reporter = threading.Thread(
        target=run_report, args=(args.report_seconds, agent.identity.job_id, found), daemon=True
    )
    if rank == 0:
        reporter.start()
    while True:
        steps(10)
        flag.fill_(1.0 if rank == 0 and not reporter.is_alive() else 0.0)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            break
    # 2. every step sampled for CUDA events, the profiler on the same steps
    agent.loop.resolver.stride = lambda current: 1  # keep 1: every step sampled
    agent.probe.event_every = 1
    steps(150)  # the stride in force before runs out first
    trace = Path(tempfile.mkdtemp(prefix="torchtop-nccl-")) / f"rank{rank}.pt.trace.json.gz"
    from torch.profiler import ProfilerActivity, profile, schedule

    cuda = job.device.type == "cuda"
    prof = profile(
        activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
        schedule=schedule(wait=0, warmup=0, active=args.window, repeat=1),
    )
    first = agent.probe.steps  # the torchtop index of ProfilerStep#0
    prof.start()
    for _ in range(args.window):
        steps(1)
        prof.step()
    prof.stop()
    prof.export_chrome_trace(str(trace))
    if cuda:
        torch.cuda.synchronize()
    steps(10)  # the window's events resolve and ship meanwhile
    ours = torchtop_steps(agent, first, args.window)
    theirs = profiler_exposed_ms(trace)
    if args.keep:  # for tests/gpu/exposed_where.py: the trace and torchtop's device ms of its steps
        keep = Path(args.keep)
        keep.mkdir(parents=True, exist_ok=True)
        (keep / trace.name).write_bytes(trace.read_bytes())
        (keep / f"rank{rank}.torchtop.json").write_text(json.dumps({"first": first, "steps": ours}))
    rows = []
    for k in range(args.window):
        tt = ours.get(first + k, {}).get("comm")
        pf = theirs.get(k)
        if tt is not None and pf is not None:
            rows.append((first + k, tt, pf))
    lines = [f"rank {rank}: exposed collective wait per step, torchtop (CUDA events) vs torch.profiler (ms)"]
    for i, tt, pf in rows:
        lines.append(
            f"  step {i:5d}  torchtop {tt:8.3f}  profiler {pf:8.3f}  diff {100 * (tt - pf) / pf if pf else 0:+6.1f}%"
        )
    ok = True
    if rows:
        mt, mp = sum(r[1] for r in rows) / len(rows), sum(r[2] for r in rows) / len(rows)
        rel = (mt - mp) / mp if mp else 0.0
        waits = rank != job.slow_rank
        verdict = "agrees" if abs(rel) <= 0.10 else "differs"
        lines.append(
            f"  mean over {len(rows)} steps: torchtop {mt:.3f} ms, profiler {mp:.3f} ms ({rel:+.1%}): {verdict}"
            + ("" if waits else " (the slow rank: it waits least, a small figure)")
        )
        ok = not waits or abs(rel) <= 0.10
    else:
        lines.append(f"  no step to compare (torchtop sampled {len(ours)}, profiler {len(theirs)})")
        ok = False
    if rank == 0:
        report = found.get("report")
        if report is None:
            print(f"torchtop report failed: {found.get('stderr', '')[-2000:]}", flush=True)
            ok = False
        else:
            v, s = report["verdict"], report["straggler"]
            print(f"job verdict: {v['kind']} ({v['severity']})")
            for e in v["evidence"]:
                print(f"  {e}")
            print(f"straggler: {json.dumps(s)}")
            print(f"scaling: {json.dumps(report['scaling'])}")
            print(f"collective: {json.dumps(report['collective'])}")
            want = {"data": "data", "forward": "forward", "backward": "backward"}.get(args.slow)
            named = (
                s is not None
                and s["rank"] == job.slow_rank
                and (s["imbalance"] if args.slow == "work" else s["phase"] == want)
            )
            for e in report["ranks"]:  # each rank's own verdict: the waiting ones wait for the slow rank
                print(f"rank {e['rank']}: {e['verdict']['kind']}: {e['verdict']['evidence'][0]}")
                print(f"  comm by group (ms a step): {json.dumps(e.get('comm_by_group_ms'))}")
            print(f"the verdict names rank {job.slow_rank} in {want}: {'yes' if named else 'NO'}", flush=True)
            ok = ok and named
    for r in range(job.world):  # each rank's comparison, in rank order
        if r == rank:
            print("\n".join(lines), flush=True)
        dist.barrier()
    if agent.probe.failures:  # a hook that raised: the figures above lost steps (the probe stops at 20)
        print(f"rank {rank}: {agent.probe.failures} hook failures", flush=True)
        ok = False
    good = torch.tensor([1.0 if ok else 0.0], device=job.device)
    dist.all_reduce(good, op=dist.ReduceOp.MIN)
    oks = [good.item() > 0]
    dist.destroy_process_group()
    return 0 if all(oks) else 1


if __name__ == "__main__":
    sys.exit(main())
