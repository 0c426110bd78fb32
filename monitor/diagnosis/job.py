"""A job's diagnosis and its `torchtop report`: pure functions of a JobState.

The job's verdict is the straggler when one rank holds the others back (straggler.py): a rank's
slow loader is that rank's straggler reason, not a job-wide data-loading verdict. Without one,
it is `communication` when every rank waits in collectives, else the verdict of the job's
aggregate steps (the mean rank) as for one run.
"""

from __future__ import annotations

from typing import Any

from torchtop.monitor.diagnosis.diagnose import diagnose
from torchtop.monitor.diagnosis.facts import THRESHOLDS as T
from torchtop.monitor.diagnosis.facts import Diagnosis
from torchtop.monitor.diagnosis.job_rules import JobFacts
from torchtop.monitor.diagnosis.report import build_report
from torchtop.monitor.diagnosis.selection import job_verdict
from torchtop.monitor.diagnosis.straggler import Straggler, find_straggler, scaling
from torchtop.monitor.model.job import JobState, Member
from torchtop.monitor.model.rank_stats import RankTimes

WINDOW_S = 10.0


def window_end(job: JobState) -> float | None:
    """The end of the job's latest second of steps: every rank is judged over the same span."""
    ends = [m.stats.levels[0][-1].t + 1 for m in job.live() if m.stats.levels[0]]
    return max(ends) if ends else None


def rank_times(job: JobState, seconds: float = WINDOW_S) -> dict[int, RankTimes]:
    """Each running rank's mean figures over the job's last `seconds` (gone ranks left out)."""
    end = window_end(job)
    out: dict[int, RankTimes] = {}
    for m in job.live():
        t = m.stats.window(seconds, end)
        if t.steps:
            out[m.rank] = t
    return out


def diagnose_job(
    job: JobState, previous: Diagnosis | None = None, seconds: float = WINDOW_S
) -> tuple[Diagnosis, Straggler | None]:
    """The job's verdict (and the straggler behind it, if any) and the aggregate's flags; the
    job rules run through the catalogue's selection, with its hysteresis (`previous`)."""
    base = diagnose(job.job, previous)
    times = rank_times(job, seconds)
    before = previous.verdict.kind if previous is not None else None
    verdict = job_verdict(JobFacts(times, base.verdict.kind), before)
    if verdict is None:
        return base, None
    found = None
    if verdict.kind == "straggler":
        found = find_straggler(times, T["hysteresis"] if before == "straggler" else 1.0)
    return Diagnosis(verdict, base.flags, base.steps), found


def member_status(m: Member, now: float) -> str:
    if m.refused:
        return "refused"
    if m.hello is None:
        return "unreachable" if m.error else "waiting"
    return m.state.connection(now)


def _rank_entry(m: Member, seconds: float, window: float, now: float) -> dict[str, Any]:
    hello = m.hello
    report = build_report(m.state, seconds, m.key, window=window)
    t = m.stats.window(window)
    keep = (
        "steps", "steps_in_full", "timed_steps", "step_time_ms", "steps_per_s", "breakdown", "phase_ms", "device_ms",
        "memory", "gpu", "host", "verdict", "flags", "dropped", "gaps", "bad_frames", "hook_errors",
    )  # fmt: skip
    entry: dict[str, Any] = {
        "rank": m.rank,
        "local_rank": hello.local_rank if hello else None,
        "node": m.node,
        "pid": hello.pid if hello else None,
        "target": m.key,
        "status": member_status(m, now),
        "agent_version": hello.agent_version if hello else None,
        "comm_ms": round(t.comm_ms, 4),
        "comm_source": "device" if t.sampled and "comm" in t.device else "host",
        "busy_ms": round(t.busy_ms, 4),
    }
    entry |= {k: report[k] for k in keep}
    if m.error:
        entry["error"] = m.error
    return entry


def build_job_report(
    job: JobState,
    seconds: float,
    target: str = "",
    window: float | None = None,
    now: float = 0.0,
    baseline_ms: float | None = None,
) -> dict[str, Any]:
    """One JSON object: the job, its ranks, the collective figures, the straggler, the scaling."""
    window = seconds if window is None else window
    diagnosis, found = diagnose_job(job, None, window)
    times = rank_times(job, window)
    aggregate = build_report(job.job, seconds, "job", window=window)
    comms = {r: t.comm_ms for r, t in times.items()}
    scale = scaling(times, baseline_ms)
    versions = job.versions()
    return {
        "target": target,
        "job_id": job.job_id,
        "seconds": seconds,
        "history": window != seconds,
        "world_size": max((m.hello.world_size for m in job.ranked() if m.hello), default=0),
        "nodes": sorted({m.node for m in job.ranked()}),
        "device": aggregate["device"],
        "ranks": [_rank_entry(m, seconds, window, now) for m in job.ranked()],
        "job": {
            k: aggregate[k]
            for k in (
                "steps",
                "steps_in_full",
                "timed_steps",
                "covered_s",
                "step_time_ms",
                "steps_per_s",
                "breakdown",
                "phase_ms",
                "device_ms",
            )  # fmt: skip
        },
        "collective": {
            "source": "device" if any(t.sampled and "comm" in t.device for t in times.values()) else "host",
            "comm_ms": {str(r): round(v, 4) for r, v in sorted(comms.items())},
            "median_ms": round(sorted(comms.values())[len(comms) // 2], 4) if comms else 0.0,
            "min_ms": round(min(comms.values()), 4) if comms else 0.0,
            "max_ms": round(max(comms.values()), 4) if comms else 0.0,
        },
        "straggler": found.to_json() if found is not None else None,
        "scaling": scale.to_json() if scale is not None else None,
        "versions": versions,
        "notes": list(job.notes),
    } | diagnosis.to_json()
