"""A job's figures as metric samples: each rank's summary series and the job's verdict. Pure.

What `torchtop export --store`/ssh targets publish for a job watched through its nodes' relays
(or rank by rank): per rank, from its buckets over the window (the Ranks tab's figures),
labelled job, node and rank; for the job, coverage and the straggler (its rank, what it costs).
Cardinality: RANK_SERIES series a rank plus JOB_SERIES for the job (docs/multi-rank.md); `top`
keeps the per-rank series to the slowest ranks and those not reporting.
"""

from __future__ import annotations

from typing import Any

from torchtop.contract.logcodes import PHASES
from torchtop.monitor.diagnosis.events import EventLog, stalled_s
from torchtop.monitor.diagnosis.facts import SEVERITY_RANK, Diagnosis
from torchtop.monitor.diagnosis.job_diagnosis import diagnose_job, window_end
from torchtop.monitor.export.figures import Sample, event_samples
from torchtop.monitor.model.job_state import JobState
from torchtop.monitor.model.relayed import coverage, relay_status
from torchtop.monitor.model.state import Link

RANK_SERIES = 4 + len(PHASES)  # reporting, step, own, comm, and each phase: 12
JOB_SERIES = 9  # and the verdict in force, the stall's seconds; events: one a (kind, severity) seen


def job_samples(
    job: JobState,
    window: float,
    label: str,
    now: float,
    top: int | None = None,
    verdicts: dict[str, Diagnosis] | None = None,
    events: dict[str, EventLog] | None = None,
) -> list[Sample]:
    """The job's samples over the last `window` seconds; per-rank series for every rank, or only
    for the `top` slowest (by own time) and any rank not reporting. `verdicts`: each job's verdict
    in force, updated (the exporter's hysteresis: the same headline as the live view); `events`:
    each job's event log, updated (its counter counts a change once, not once a refresh)."""
    out: list[Sample] = []
    jl = (("job", label),)

    def add(name: str, value: float, labels: tuple[tuple[str, str], ...]) -> None:
        if value == value and abs(value) != float("inf"):  # NaN and inf left out
            out.append(Sample(name, float(value), labels, "gauge"))

    end = window_end(job)
    rows: list[tuple[Any, Any, bool]] = []
    for m in job.ranked():
        ok = m.state.link(now) == Link.CONNECTED and relay_status(job, m, now) is None
        rows.append((m, m.stats.window(window, end), ok))
    keep = {m.key for m, _, _ in rows}
    if top is not None:
        slowest = sorted((r for r in rows if r[1].steps), key=lambda r: -r[1].busy_ms)[:top]
        keep = {m.key for m, _, _ in slowest} | {m.key for m, _, ok in rows if not ok}
    for m, t, ok in rows:
        if m.key not in keep:
            continue
        labels = jl + (("node", m.node), ("rank", str(m.rank)))
        add("torchtop_rank_reporting", 1.0 if ok else 0.0, labels)
        if not t.steps:
            continue
        add("torchtop_rank_step_seconds", t.step_ms / 1e3, labels)
        add("torchtop_rank_own_seconds", t.busy_ms / 1e3, labels)
        add("torchtop_rank_comm_seconds", t.comm_ms / 1e3, labels)
        if t.timed:
            for phase in PHASES:
                add("torchtop_rank_phase_seconds", t.cost(phase) / 1e3, labels + (("phase", phase),))
    c = coverage(job, now)
    add("torchtop_job_ranks_reporting", c.reporting, jl)
    add("torchtop_job_ranks_expected", c.expected, jl)
    add("torchtop_job_nodes_silent", len(c.silent), jl)
    verdicts = {} if verdicts is None else verdicts
    verdicts[job.job_id], found = diagnose_job(job, verdicts.get(job.job_id), window)
    add("torchtop_job_straggler_rank", found.rank if found is not None else -1, jl)
    add("torchtop_job_straggler_wait_share_ratio", found.share if found is not None else 0.0, jl)
    add("torchtop_job_straggler_slowdown", found.slowdown if found is not None else 1.0, jl)
    add(
        "torchtop_job_straggler_severity",
        SEVERITY_RANK.get(found.severity, 0) if found is not None else 0,
        jl,
    )
    v = verdicts[job.job_id].verdict
    if v.kind != "unknown":
        add(
            "torchtop_verdict",
            SEVERITY_RANK.get(v.severity, 0),
            (*jl, ("verdict", v.kind), ("severity", v.severity)),
        )
    log = None
    if events is not None:
        log = events.setdefault(job.job_id, EventLog())
        log.observe(verdicts[job.job_id], end if end is not None else now)
    states = [m.state for m in job.live() if m.hello is not None]
    return out + event_samples(jl, log, stalled_s(states))
