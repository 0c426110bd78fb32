"""The pipeline bubble: the share of a pipeline stage's step spent waiting on its neighbours.

A pipeline schedule (torch.distributed.pipelining) waits for its neighbour stages' send/recv in
`_wait_batch_p2p`; the agent names that wait PIPELINE (agent/hooks/waits.py) and the replay
counts it in the step's `comm_groups` apart from the collectives. It is the schedule's fill and
drain (a balanced GPipe of S stages over M micro-batches idles about (S-1)/(M+S-1) of the step)
plus any wait for a slower stage, which the straggler rule then names. Read from the last timed
steps each rank's monitor state holds (a relayed rank has none here: unknown): on NCCL the
compute stream's wait of those sampled for CUDA events (the host only posts the send/recv, 9.1
ms on the GPU against ~0 on the host on an H200), elsewhere the host's. Pure functions.
"""

from __future__ import annotations

from dataclasses import replace
from statistics import median

from torchtop.contract.logcodes import PIPELINE
from torchtop.monitor.diagnosis.facts import THRESHOLDS as T
from torchtop.monitor.diagnosis.facts import Finding
from torchtop.monitor.model.fmt import pct
from torchtop.monitor.model.job_state import JobState, Member

LAST_STEPS = 64  # the newest timed steps a rank's bubble is read from (the job view reads it twice a second)


def rank_bubble(m: Member, seconds: float) -> float | None:
    """Mean ms a timed step this rank's pipeline schedule waited for its neighbour stages over
    its last `seconds`; None where no timed step of it waited in one (not a pipeline stage)."""
    horizon = m.state.agent_time - seconds
    ns = timed = seen = 0
    ms, sampled, on_gpu = 0.0, 0, 0  # the GPU's wait on steps sampled for CUDA events (NCCL)
    for s in reversed(m.state.steps):
        if s.t0 + s.wall_ns / 1e9 < horizon or timed >= LAST_STEPS:
            break
        if s.kind != "train" or not s.phases:
            continue
        timed += 1
        wait = s.comm_groups.get(PIPELINE)
        if wait is not None:
            ns, seen = ns + wait, seen + 1
        if s.device_ms:
            sampled += 1
            gpu = s.device_groups.get(PIPELINE)
            if gpu is not None:
                ms, on_gpu = ms + gpu, on_gpu + 1
    if on_gpu:  # on NCCL the host only posts the send/recv: the compute stream is what waits
        return ms / sampled
    return ns / timed / 1e6 if seen else None


def job_bubbles(job: JobState, seconds: float) -> dict[int, float]:
    """Each running pipeline rank's bubble, ms a step (ranks without one left out)."""
    out: dict[int, float] = {}
    for m in job.live():
        b = rank_bubble(m, seconds)
        if b is not None:
            out[m.rank] = b
    return out


def bubble_line(rank: int, bubble_ms: float, step_ms: float, straggler: int | None = None) -> str:
    """The rank's bubble in words, and whom it waits for where a slower stage is known."""
    share = bubble_ms / step_ms if step_ms > 0 else 0.0
    whom = (
        f"rank {rank} waits for the slower stage on rank {straggler}"
        if straggler is not None and straggler != rank
        else f"rank {rank} waits on its neighbour stages' send/recv"
    )
    return f"pipeline bubble {pct(share, 0)} of the step ({bubble_ms:.1f} ms of {step_ms:.1f} ms: {whom})"


def stage_params(job: JobState) -> dict[int, int]:
    """Each running rank's root modules' parameters (a pipeline stage's own), where its agent
    counted them."""
    return {m.rank: m.state.why.params for m in job.live() if m.state.why.params}


SAME_WORK_LINE = "is slower at the same work"


def with_stage_work(verdict: Finding, rank: int, params: dict[int, int]) -> Finding:
    """A pipeline's slower stage compared by its work: the parameters its stage holds against the
    median other stage's (not its FLOPs a step: the count misses a first stage's backward, whose
    input needs no gradient). Heavier by `work_imbalance`: it holds more layers (move some to its
    neighbours), not a slower GPU or host at the same work."""
    others = [n for r, n in params.items() if r != rank]
    if rank not in params or not others:
        return verdict
    ratio = params[rank] / median(others)
    if ratio < T.work_imbalance:
        return verdict
    earlier = any(r < rank for r in params if r != rank)
    where = "earlier" if earlier else "later"
    n = sum(1 for r in params if r != rank and (r < rank) == earlier)
    line = (
        f"the stage on rank {rank} holds {ratio:.1f}x the parameters of the median stage: "
        f"move layers to the {where} stage{'s' if n > 1 else ''}"
    )
    evidence = [e for e in verdict.evidence if SAME_WORK_LINE not in e]
    evidence.insert(1, line)
    advice = (
        f"split the model by work: move layers from the stage on rank {rank} to its {where} "
        f"neighbour{'s' if n > 1 else ''} (parameters, or the stages' measured forward times)",
        "the last stage also runs the loss: give it fewer layers than the others",
    )
    return replace(verdict, evidence=tuple(evidence), advice=advice)
