"""Synthetic ranks of a job for the job model, rules and view tests: steps with known phases
(tests/job_util.py runs a real training job; this one makes ranks by hand)."""

from __future__ import annotations

from torchtop.contract import wire
from torchtop.monitor.model.job_state import JobState
from torchtop.monitor.model.steps import StepRecord

T0 = 1_700_000_000.0
JOB = "run-1@node0:29500"


def hello(
    rank: int, world: int = 4, job_id: str = JOB, host: str = "node0", version: str = "0.1.0"
) -> wire.Hello:
    return wire.Hello(
        v=wire.PROTOCOL_VERSION,
        run_id=f"run{rank}",
        pid=1000 + rank,
        host=host,
        port=40000 + 2 * rank,
        pub_port=40001 + 2 * rank,
        device="cpu",
        start_time=T0,
        rank=rank,
        world_size=world,
        local_rank=rank,
        agent_version=version,
        job_id=job_id,
        launcher="torchrun",
    )


def batch(rank: int, seq: int, t: float) -> wire.Batch:
    return wire.Batch(v=wire.PROTOCOL_VERSION, run_id=f"run{rank}", seq=seq, time=t, rank=rank)


def rank_steps(
    rank: int,
    n: int = 100,
    step_ms: float = 50.0,
    data: float = 1.0,
    forward: float = 3.0,
    backward: float = 5.0,
    optimizer: float = 1.0,
    comm: float | None = None,
    first: int = 0,
    device: dict[str, float] | None = None,
) -> list[StepRecord]:
    """`n` steps of `step_ms`; `comm` (default: the rest less 0.5 ms of `other`) fills the step."""
    own = data + forward + backward + optimizer
    comm = max(0.0, step_ms - own - 0.5) if comm is None else comm
    phases = {
        "data": data,
        "h2d": 0.0,
        "forward": forward,
        "backward": backward,
        "optimizer": optimizer,
        "comm": comm,
    }
    ns = {k: int(v * 1e6) for k, v in phases.items()}
    wall = int(step_ms * 1e6)
    ns["other"] = max(0, wall - sum(ns.values()))
    return [
        StepRecord(
            first + k, T0 + (first + k) * step_ms / 1e3, wall, dict(ns), "train", 1, dict(device or {}), rank
        )
        for k in range(n)
    ]


def feed(job: JobState, per_rank: dict[int, list[StepRecord]], chunk: int = 10) -> None:
    """Every rank's hello, then its steps in batches of `chunk`, the ranks interleaved."""
    for r in per_rank:
        job.apply_hello(f"r{r}", hello(r, world=len(per_rank)))
    longest = max(len(s) for s in per_rank.values())
    for seq, k in enumerate(range(0, longest, chunk)):
        for r, steps in per_rank.items():
            part = steps[k : k + chunk]
            if part:
                end = part[-1].t0 + part[-1].wall_ns / 1e9
                job.apply_batch(f"r{r}", batch(r, seq, end), part, now=float(seq))
