"""A rank's own verdict inside a job: it agrees with the job's.

A rank that waits for a straggler is not `sync`-bound, nor is its GPU idle: it waits in its
collectives for that rank, and its line says so ("waiting for rank 1 (43.2 ms a step)"), with
the fix on the straggler. The straggler's own line is the job's verdict. Without a straggler, a
rank keeps its own verdict where its figures really differ (a warning or worse of its own kind);
otherwise, and where its own verdict would read a collective wait as a sync or host overhead,
it reads the job's: ranks doing the same work get the same verdict. Pure functions.
"""

from __future__ import annotations

from torchtop.monitor.diagnosis.facts import THRESHOLDS as T
from torchtop.monitor.diagnosis.facts import Diagnosis, Finding
from torchtop.monitor.diagnosis.straggler import Straggler
from torchtop.monitor.model.fmt import pct
from torchtop.monitor.model.rank_stats import RankTimes

JOB_KINDS = ("straggler", "work-imbalance", "host-bound", "communication", "no-bottleneck")
# a rank's own verdicts that a collective wait can mimic: the host blocked (sync), little compute
COMM_MIMICS = ("sync", "host-overhead", "outside-phases", "host-code")


def waiting_finding(rank: int, found: Straggler, times: dict[int, RankTimes], job: Finding) -> Finding:
    """`rank` waits for the straggler: how long a step, and where the fix is."""
    t = times.get(rank)
    slow = times.get(found.rank)
    wait = found.wait_ms if t is None or slow is None else max(0.0, t.comm_ms - slow.comm_ms)
    step = t.step_ms if t is not None else found.step_ms
    share = wait / step if step > 0 else 0.0
    evidence = (
        f"waiting for rank {found.rank} ({wait:.1f} ms a step) in collectives: {pct(share, 0)} of its "
        f"{step:.1f} ms step",
        job.evidence[0],
    )
    advice = (f"the fix is on rank {found.rank}, not here: {job.advice[0]}",) if job.advice else ()
    return Finding("waiting", found.severity, share, evidence, advice, job.upside)


def rank_diagnosis(
    own: Diagnosis,
    rank: int,
    job: Diagnosis,
    found: Straggler | None,
    times: dict[int, RankTimes],
) -> Diagnosis:
    """What `rank`'s line says inside its job (its own flags kept)."""
    if found is not None:  # judged over the job's window, even while this rank's own is warming up
        if rank == found.rank:
            return Diagnosis(job.verdict, own.flags, own.steps, oom=own.oom)
        return Diagnosis(waiting_finding(rank, found, times, job.verdict), own.flags, own.steps, oom=own.oom)
    if own.verdict.kind == "unknown":
        return own
    t = times.get(rank)
    waits = t is not None and t.step_ms > 0 and t.comm_ms / t.step_ms >= T.straggler_info
    # a host-bound job's ranks read it: their own host-overhead or host-code is the same finding
    if own.verdict.kind in COMM_MIMICS and (waits or job.verdict.kind == "host-bound"):
        return Diagnosis(job.verdict, own.flags, own.steps, oom=own.oom)
    if own.verdict.kind != job.verdict.kind and own.verdict.severity in ("ok", "info"):
        return Diagnosis(job.verdict, own.flags, own.steps, oom=own.oom)
    return own
