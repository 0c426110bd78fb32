"""A job's diagnosis and its `torchtop report`: pure functions of a JobState.

The job's verdict is the straggler when one rank holds the others back (straggler.py, by the
job model of job_model.py): a rank's slow loader is that rank's straggler reason, not a job-wide
data-loading verdict. Without one, it is `host-bound` when every rank's host sets the pace while
the GPUs idle, `pipeline-bubble` when every pipeline stage idles waiting for its neighbours
(bubble.py), `communication` when every rank waits in collectives, `no-bottleneck` when nothing
stands out, else the verdict of the job's aggregate steps (the mean rank) as for one run. A
pipeline rank's line says its bubble. The verdict in force holds unless the evidence moves past
its hysteresis (selection.job_verdict); once the job's ranks are gone its last verdict stays,
marked as ended.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import msgspec

from torchtop.contract.logcodes import PIPELINE
from torchtop.monitor.diagnosis.bubble import bubble_line, job_bubbles, stage_params, with_stage_work
from torchtop.monitor.diagnosis.cpu_wait import ADVICE as CPU_ADVICE
from torchtop.monitor.diagnosis.cpu_wait import cpu_waits, starved_line
from torchtop.monitor.diagnosis.diagnose import diagnose, facts
from torchtop.monitor.diagnosis.facts import THRESHOLDS as T
from torchtop.monitor.diagnosis.facts import Diagnosis
from torchtop.monitor.diagnosis.in_job import rank_diagnosis
from torchtop.monitor.diagnosis.job_model import HostSide, host_busy, host_side
from torchtop.monitor.diagnosis.job_phases import times_diagnosis
from torchtop.monitor.diagnosis.job_rules import JobFacts
from torchtop.monitor.diagnosis.report import run_report, with_diagnosis, with_line
from torchtop.monitor.diagnosis.report_types import (
    CollectiveReport,
    CoverageReport,
    JobFigures,
    JobReport,
    RankEntry,
    SilentNode,
    StepTimeMs,
    StragglerReport,
    WorkReport,
)
from torchtop.monitor.diagnosis.selection import job_verdict
from torchtop.monitor.diagnosis.stall import job_stall, with_job_resumed
from torchtop.monitor.diagnosis.straggler import Straggler, scaling, work_report
from torchtop.monitor.diagnosis.window import Window, choose, job_window, judged_steps
from torchtop.monitor.model.energy import job_energy, rounded
from torchtop.monitor.model.job_state import JobState, Member
from torchtop.monitor.model.rank_stats import RankTimes
from torchtop.monitor.model.relayed import coverage, coverage_line, relay_status

WINDOW_S = T.window_s  # window.py's: one span for the job view, its report and export


def window_end(job: JobState) -> float | None:
    """The end of the job's latest second of steps: every rank is judged over the same span."""
    ends = [m.stats.levels[0][-1].t + 1 for m in job.live() if m.stats.levels[0]]
    return max(ends) if ends else None


def rank_times(job: JobState, seconds: float = WINDOW_S, end: float | None = None) -> dict[int, RankTimes]:
    """Each running rank's mean figures over the job's last `seconds` (gone ranks left out)."""
    end = window_end(job) if end is None else end
    out: dict[int, RankTimes] = {}
    for m in job.live():
        t = m.stats.window(seconds, end)
        if t.steps:
            out[m.rank] = t
    return out


JUDGE_STEPS = 6_000  # a job report's history per rank: the last minute's 10 s spans (job_model)
SAMPLED_RANKS = 32  # ranks whose seconds the noise band and the slowest-in-seconds read
HOST_RANKS = 4  # ranks whose own facts say whether their GPU idles (host-bound): 2-4 ms each
ENDED = "ended: the job's last verdict while its ranks ran (none answers now)"


def rank_seconds(
    job: JobState, times: dict[int, RankTimes], seconds: float, end: float | None
) -> dict[int, list[tuple[int, RankTimes]]]:
    """The per-second figures of the ranks with the most own time (the straggler and its
    closest rivals), over the same window as `times`."""
    if seconds == float("inf"):
        seconds = WINDOW_S  # a whole history is judged by its means; its last seconds give the band
    top = set(sorted(times, key=lambda r: -times[r].busy_ms)[:SAMPLED_RANKS])
    return {m.rank: m.stats.seconds(seconds, end) for m in job.live() if m.rank in top}


def host_sides(
    job: JobState, times: dict[int, RankTimes], gpu: bool, seconds: float = WINDOW_S
) -> dict[int, HostSide]:
    """A few ranks' host and GPU from their own facts, only where the job may be host-bound (on
    GPUs, every rank's host busy near the whole step): the costly part is paid rarely."""
    near = 1.0 - (1.0 - T.host_bound) / T.hysteresis
    judged = {r: t for r, t in times.items() if t.steps >= T.min_steps and t.timed}
    if not gpu or len(judged) < 2 or min(host_busy(t) for t in judged.values()) < near:
        return {}
    by_wait = sorted(judged, key=lambda r: judged[r].comm_ms)
    pick = {*by_wait[: HOST_RANKS // 2], *by_wait[-HOST_RANKS // 2 :]}  # the latest and the earliest
    out: dict[int, HostSide] = {}
    for m in job.live():
        if m.rank in pick and m.state.steps:
            steps = judged_steps(m.state, seconds)
            if steps:
                out[m.rank] = host_side(facts(m.state, steps))
    return out


def ended(d: Diagnosis | None) -> bool:
    """The diagnosis is a job's last one, kept after its ranks went away."""
    return d is not None and bool(d.verdict.evidence) and d.verdict.evidence[0] == ENDED


def diagnose_job(
    job: JobState,
    previous: Diagnosis | None = None,
    seconds: float = WINDOW_S,
    end: float | None = None,
    chosen: Window | None = None,
) -> tuple[Diagnosis, Straggler | None]:
    """The job's verdict (and the straggler behind it, if any) and the aggregate's flags; the
    job rules run through the catalogue's selection, with its hysteresis (`previous`). A job
    whose ranks are all gone keeps `previous`, marked as ended (while one is left, unmarked)."""
    live = job.live()
    if (
        previous is not None
        and len(job.ranked()) >= 2
        and len(live) < 2
        and previous.verdict.kind != "unknown"
    ):
        if live or ended(previous):
            return previous, None
        v = previous.verdict
        return replace(previous, verdict=replace(v, evidence=(ENDED, *v.evidence))), None
    # the ranks' own judged steps, pooled: the job's figures are those of the ranks' own lines
    base = diagnose(job.job, previous, window=job_window(job, seconds) if chosen is None else chosen)
    states = {m.rank: m.state for m in live if m.hello is not None}
    pooled = max(1, len(states))
    stalled = job_stall(states)
    if stalled is not None:  # before the job rules: no straggler is named from the stalled seconds
        return Diagnosis(stalled, base.flags, base.steps, base.step_ms, ranks=pooled), None
    base = replace(base, verdict=with_job_resumed(base.verdict, states), ranks=pooled)
    times = rank_times(job, seconds, end)
    if not job.job.steps:  # every rank relayed: the job's phases from the ranks' buckets (one answer)
        device = job.job.hello.device if job.job.hello is not None else "cpu"
        base = times_diagnosis(times, device, previous.verdict.kind if previous else None) or base
    bubble = job_bubbles(job, seconds)
    before = previous.verdict.kind if previous is not None else None
    device = job.job.hello.device if job.job.hello is not None else ""
    gpu = device.startswith("cuda") or any(t.sampled for t in times.values())
    seconds_ = rank_seconds(job, times, seconds, end)
    hosts = host_sides(job, times, gpu, seconds)
    j = JobFacts(times, base.verdict.kind, bubble, seconds_, hosts, gpu, base.verdict.share)
    verdict = job_verdict(j, before)
    if verdict is None:
        return base, None
    found = None
    if verdict.kind in ("straggler", "work-imbalance"):
        found = j.straggler(T.hysteresis if before == verdict.kind else 1.0)
        if found is not None and bubble:  # a pipeline's slower stage, compared by its work
            verdict = with_stage_work(verdict, found.rank, stage_params(job))
        starved = starved_line(found.rank, cpu_waits(states, seconds)) if found is not None else None
        if starved is not None:  # the rank waits for a core: the host, not the model, first
            ev, advice = verdict.evidence, (CPU_ADVICE, *verdict.advice)[:3]
            verdict = replace(verdict, evidence=(ev[0], starved, *ev[1:]), advice=advice)
        waiting = max((r for r in bubble if r in times), key=lambda r: bubble[r], default=None)
        if found is not None and waiting is not None and waiting != found.rank:
            line = bubble_line(waiting, bubble[waiting], times[waiting].step_ms, found.rank)
            verdict = replace(verdict, evidence=(*verdict.evidence[:2], line, *verdict.evidence[2:]))
    return Diagnosis(
        with_job_resumed(verdict, states), base.flags, base.steps, base.step_ms, ranks=pooled
    ), found


def settled_job(
    job: JobState, seconds: float = WINDOW_S, chosen: Window | None = None
) -> tuple[Diagnosis, Straggler | None]:
    """A one-off report's job verdict with the hysteresis a live view has: the window before
    this one judged first, as the verdict in force (a recording's report says what the live
    view said)."""
    end = window_end(job)
    prior = None
    if end is not None and seconds != float("inf") and rank_times(job, seconds, end - seconds):
        prior, _ = diagnose_job(job, None, seconds, end - seconds)
    return diagnose_job(job, prior, seconds, chosen=chosen)


def rank_view(
    job_diagnosis: Diagnosis,
    own: Diagnosis,
    rank: int,
    found: Straggler | None = None,
    times: dict[int, RankTimes] | None = None,
    bubble: float | None = None,
) -> Diagnosis:
    """What a rank's view says inside its job (one job, one answer: a rank alone cannot tell a
    straggler's wait or the collectives' cost): the line in_job.rank_diagnosis gives it (the job's
    verdict, or "waiting for rank N"), its own flags, and its own verdict as a line of evidence
    where that reads otherwise."""
    verdict = rank_diagnosis(own, rank, job_diagnosis, found, times or {}).verdict
    t = (times or {}).get(rank)
    if bubble is not None and t is not None and verdict.kind != "pipeline-bubble":
        line = bubble_line(rank, bubble, t.step_ms, found.rank if found is not None else None)
        verdict = replace(verdict, evidence=(verdict.evidence[0], line, *verdict.evidence[1:]))
    if own.verdict.kind not in (verdict.kind, "unknown"):
        line = (
            f"rank {rank} on its own reads {own.verdict.kind} ({own.verdict.severity}); the job rules decide"
        )
        verdict = replace(verdict, evidence=(*verdict.evidence, line))
    return Diagnosis(verdict, own.flags, own.steps, own.step_ms, own.oom)


def member_status(m: Member, now: float, job: JobState | None = None) -> str:
    relayed = relay_status(job, m, now) if job is not None else None
    if relayed is not None:
        return relayed
    if m.refused:
        return "refused"
    if m.hello is None:
        return "unreachable" if m.error else "waiting"
    return m.state.connection(now)


def _rank_entry(
    job: JobState,
    m: Member,
    seconds: float,
    window: float,
    now: float,
    judged: tuple[Diagnosis, Straggler | None, dict[int, RankTimes]],
) -> RankEntry:
    hello = m.hello
    own = choose(m.state, window)  # the rank's line, its verdict and its hot spots: one window
    mine = diagnose(m.state, window=own)
    report = run_report(m.state, seconds, m.key, window=window, chosen=own, judged=mine)
    job_diagnosis, found, times = judged
    # the rank's line agrees with the job's. m.rank is an int (-1 before a hello), never None: the
    # test is on the hello (job.ranked() hands only members with one, so none is skipped today)
    groups = comm_by_group(m, window)
    # the report's bubble is its comm's pipeline part over the same steps as its phases (the live
    # view's rank_bubble reads the newest steps only, so it could exceed the window's comm)
    bubble = groups.get(PIPELINE)
    if m.hello is not None:
        with_diagnosis(report, rank_view(job_diagnosis, mine, m.rank, found, times, bubble))
    t = m.stats.window(window)
    entry = RankEntry(
        rank=m.rank,
        local_rank=hello.local_rank if hello else None,
        node=m.node,
        pid=hello.pid if hello else None,
        target=m.key,
        status=member_status(m, now, job),
        agent_version=hello.agent_version if hello else None,
        comm_ms=round(t.comm_ms, 4),
        comm_source="device" if t.sampled and "comm" in t.device else "host",
        busy_ms=round(t.busy_ms, 4),
        steps=report.steps,
        steps_in_full=report.steps_in_full,
        timed_steps=report.timed_steps,
        step_time_ms=report.step_time_ms,
        steps_per_s=report.steps_per_s,
        breakdown=report.breakdown,
        phase_ms=report.phase_ms,
        device_ms=report.device_ms,
        memory=report.memory,
        gpu=report.gpu,
        host=report.host,
        verdict=report.verdict,
        flags=report.flags,
        dropped=report.dropped,
        gaps=report.gaps,
        bad_frames=report.bad_frames,
        hook_errors=report.hook_errors,
        comm_by_group_ms=groups,
        work=work_json(t),
        pipeline_bubble_ms=round(bubble, 4) if bubble is not None else None,
        pipeline_bubble_share=round(bubble / t.step_ms, 4) if bubble is not None and t.step_ms > 0 else None,
        energy=report.energy,
    )
    if m.via:  # read through its node's relay: its figures are its buckets', it has no steps here
        entry.via = "relay"
        entry.steps = t.steps
        entry.step_time_ms = StepTimeMs(mean=round(t.step_ms, 4))  # no steps here: no median, no p90
        entry.phase_ms = {k: round(v, 4) for k, v in t.phases.items()}
        entry.device_ms = {k: round(v, 4) for k, v in t.device.items()}
    if m.error:
        entry.error = m.error
    return entry


def work_json(t: RankTimes) -> WorkReport | None:
    """A rank's work a step and its live throughput (tokens/s where its batches have a sequence;
    None where they have none)."""
    w = t.work
    out = work_report(w)
    if w is None or out is None:
        return None
    per_s = 1000.0 / t.step_ms if t.step_ms > 0 else 0.0
    out.samples_per_s = round(w.samples * per_s, 2)
    out.tokens_per_s = round(w.tokens * per_s, 2) if w.tokens else None
    return out


def comm_by_group(m: Member, window: float) -> dict[str, float]:
    """Ms a step in the named collectives of each process group (dp, tp, pp...): the compute
    stream's wait on the steps sampled for CUDA events where a group has one (NCCL: the host
    only enqueues), else the host's over the timed steps."""
    steps = m.state.summary(window).in_full
    timed = [s for s in steps if s.phases]
    total: dict[str, int] = {}
    for s in timed:
        for name, ns in s.comm_groups.items():
            total[name] = total.get(name, 0) + ns
    out = {k: round(v / len(timed) / 1e6, 4) for k, v in total.items()} if timed else {}
    sampled = [s for s in steps if s.device_ms]
    device: dict[str, float] = {}
    for s in sampled:
        for name, ms in s.device_groups.items():
            device[name] = device.get(name, 0.0) + ms
    out.update({k: round(v / len(sampled), 4) for k, v in device.items()})
    return dict(sorted(out.items()))


def _straggler_json(job: JobState, found: Straggler | None) -> StragglerReport | None:
    """The straggler's figures, and whether it is chronic or a one-off (persistence.py)."""
    if found is None:
        return None
    from torchtop.monitor.diagnosis.persistence import persistence

    p = persistence(job, found.rank)
    out = found.to_report()
    out.persistence = p.kind
    out.slowest_in_spans = [p.slowest_in, p.spans]
    return out


def coverage_json(job: JobState, now: float) -> CoverageReport:
    c = coverage(job, now)
    return CoverageReport(
        reporting=c.reporting,
        expected=c.expected,
        line=coverage_line(c),
        silent_nodes=[SilentNode(node=n, silent_s=round(s, 1)) for n, s in c.silent],
        relays=sorted(r.node for r in job.relays.values()),
        unreached=c.unreached,
    )


def build_job_report(
    job: JobState,
    seconds: float,
    target: str = "",
    window: float | None = None,
    now: float = 0.0,
    baseline_ms: float | None = None,
) -> dict[str, Any]:
    """The job report as JSON-able data: what `torchtop report` prints for a job (job_report)."""
    return msgspec.to_builtins(job_report(job, seconds, target, window, now, baseline_ms))


def job_report(
    job: JobState,
    seconds: float,
    target: str = "",
    window: float | None = None,
    now: float = 0.0,
    baseline_ms: float | None = None,
) -> JobReport:
    """The job, its ranks, the collective figures, the straggler, the scaling."""
    window = seconds if window is None else window
    job.share_telemetry()  # the job's worker facts from the sample the Host tab shows
    chosen = job_window(job, window)  # the job's figures and its verdict read the same pooled steps
    diagnosis, found = settled_job(job, window, chosen)
    if chosen.line:  # steps longer than the span asked: judged on the ones the ranks kept, said so
        diagnosis = replace(diagnosis, verdict=with_line(diagnosis.verdict, chosen.line))
    times = rank_times(job, window)
    aggregate = run_report(job.job, seconds, "job", window=window, chosen=chosen)
    comms = {r: t.comm_ms for r, t in times.items()}
    scale = scaling(times, baseline_ms)
    a = aggregate
    ranks = [_rank_entry(job, m, seconds, window, now, (diagnosis, found, times)) for m in job.ranked()]
    return JobReport(
        target=target,
        job_id=job.job_id,
        seconds=seconds,
        history=window != seconds,
        world_size=max((m.hello.world_size for m in job.ranked() if m.hello), default=0),
        nodes=sorted({m.node for m in job.ranked()}),
        device=a.device,
        ranks=ranks,
        coverage=coverage_json(job, now),
        job=JobFigures(
            a.steps,
            a.steps_in_full,
            a.timed_steps,
            a.covered_s,
            a.step_time_ms,
            a.steps_per_s,
            a.breakdown,
            a.phase_ms,
            a.device_ms,
        ),  # fmt: skip
        collective=CollectiveReport(
            source="device" if any(t.sampled and "comm" in t.device for t in times.values()) else "host",
            comm_ms={str(r): round(v, 4) for r, v in sorted(comms.items())},
            median_ms=round(sorted(comms.values())[len(comms) // 2], 4) if comms else 0.0,
            min_ms=round(min(comms.values()), 4) if comms else 0.0,
            max_ms=round(max(comms.values()), 4) if comms else 0.0,
        ),
        straggler=_straggler_json(job, found),
        scaling=scale.to_report() if scale is not None else None,
        versions=job.versions(),
        notes=list(job.notes),
        verdict=diagnosis.verdict.to_report(),
        flags=[f.kind for f in diagnosis.flags],
        flag_details=[f.to_report() for f in diagnosis.flags],
        energy=rounded(job_energy({r.rank: (r.node, r.energy) for r in ranks})),
    )
