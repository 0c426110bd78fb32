"""The job's rules: which rank holds the others back and why, and how well the job scales.

In synchronous data-parallel training every rank runs at the pace of the slowest: the others
wait for it in their collectives (DDP's all-reduce at the end of backward). So the straggler is
the rank that waits least (its `comm` is the collective's own time, with no one to wait for);
its reason is the phase in which it spends most more than the median of the others. That tells
a rank slow in its loader (its data wait is long, its backward normal) from one slow in its
backward (its backward compute is long): the wait DDP spreads over every other rank's backward
is `comm` here, not backward time (TraceML #252 misses the second case).

It is named only when the job model (job_model.py) holds it: its own time exceeds the others'
by more than the job's noise band (measured second to second), it is the slowest in most of the
window's seconds, and its measured phases explain the others' wait; on a host-bound job only host
figures count. Then the others' median extra wait sets the severity: >= 5% of the step info,
10% warning, 20% critical (TraceML's straggler score bands 0.10 / 0.20). Pure functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median

import msgspec

from torchtop.monitor.diagnosis.facts import THRESHOLDS as T
from torchtop.monitor.diagnosis.facts import Finding, Severity
from torchtop.monitor.diagnosis.job_model import (
    Noise,
    Seconds,
    ahead_seconds,
    confidence,
    host_view,
    measure_noise,
    own_points,
    times_words,
    what_if,
)
from torchtop.monitor.diagnosis.report_types import ScalingReport, StragglerReport, WorkReport
from torchtop.monitor.model.fmt import pct
from torchtop.monitor.model.rank_stats import RankTimes, Work

OWN_PHASES = ("data", "h2d", "forward", "backward", "optimizer", "checkpoint", "other")
PHASE_WORDS = {
    "data": "data wait",
    "h2d": "host-to-device copies",
    "forward": "forward",
    "backward": "backward compute",
    "optimizer": "optimizer step",
    "checkpoint": "saving checkpoints",
    "other": "time outside the phases",
}
ADVICE = {
    "checkpoint": (
        "this rank saves while the others wait for it: save from every rank (torch.distributed.checkpoint), "
        "or asynchronously (dcp.async_save)",
    ),
    "data": (
        "this rank's input pipeline is slower: check its storage/network and its DataLoader workers",
        "more DataLoader workers or prefetching on that node; a shard of equal cost on every rank",
    ),
    "h2d": ("pin_memory=True and non_blocking copies on that rank; check its PCIe link (GPU · Host tab)",),
    "forward": (
        "this rank computes slower: a throttled or shared GPU (GPU · Host tab), or a bigger shard",
        "uneven inputs (sequence lengths): bucket or pad batches to equal cost",
    ),
    "backward": (
        "this rank's backward is slower: a throttled or shared GPU (GPU · Host tab), or more work "
        "on that rank (uneven batches, extra loss terms)",
        "DDP's all-reduce makes every other rank wait for it at the end of backward",
    ),
    "optimizer": ("this rank's optimizer step is slower: an uneven shard of the parameters?",),
    "other": (
        "this rank does more outside the training phases: logging, checkpointing or evaluation on "
        "one rank only (rank 0?) holds every rank back",
    ),
}


WORK_ADVICE = (
    "give every rank the same tokens a step: pack sequences to a fixed token budget, or bucket by length",
    "a heavier batch, the last pipeline stage or a hot expert on that rank: spread its work",
)


@dataclass(frozen=True)
class Straggler:
    """What the straggler costs the job a step."""

    rank: int
    phase: str  # the phase it is slow in ("" when none of its phases explains it)
    phase_ms: float  # its time in that phase a step
    median_ms: float  # the other ranks' median time in it
    wait_ms: float  # the other ranks' median extra collective wait a step
    step_ms: float  # the job's step time
    waiting: int  # ranks that wait for it
    severity: Severity
    work: Work | None = None  # its work a step, where its batches were seen
    median_work: Work | None = None  # the median other rank's
    new_step_ms: float = 0.0  # the what-if: the step without its excess (0: the step less the wait)
    noise: Noise = Noise(0.0, 0)  # the band its own time cleared
    slowest: tuple[int, int] = (0, 0)  # (seconds it was ahead by more than the band, seconds judged)
    gpu: bool = False  # the job runs on GPUs (else "its host", never "its GPU")
    host_only: bool = False  # judged on host figures (a host-bound job)

    @property
    def work_ratio(self) -> float | None:
        """Its tokens (else samples) a step over the median other rank's; None: not known."""
        w, m = self.work, self.median_work
        if w is None or m is None:
            return None
        if w.tokens and m.tokens:
            return w.tokens / m.tokens
        return w.samples / m.samples if m.samples else None

    @property
    def imbalance(self) -> bool:
        """It is given more work than the others (not slower at the same work)."""
        r = self.work_ratio
        return r is not None and r >= T.work_imbalance

    @property
    def share(self) -> float:
        return self.wait_ms / self.step_ms if self.step_ms > 0 else 0.0

    @property
    def after_ms(self) -> float:
        """The step it would take without the straggler's excess (job_model.what_if)."""
        return self.new_step_ms if self.new_step_ms > 0 else max(0.0, self.step_ms - self.wait_ms)

    @property
    def slowdown(self) -> float:
        """How much slower the job runs than without the straggler's excess (capped: 10 s means
        say no more)."""
        left = self.after_ms
        return min(T.speedup_cap, self.step_ms / left) if left > 0 else T.speedup_cap

    def to_report(self) -> StragglerReport:
        """Its figures; the report adds `persistence` and `slowest_in_spans` (job.py)."""
        return StragglerReport(
            rank=self.rank,
            phase=self.phase or None,
            phase_ms=round(self.phase_ms, 3),
            median_ms=round(self.median_ms, 3),
            others_wait_ms=round(self.wait_ms, 3),
            step_ms=round(self.step_ms, 3),
            waiting_ranks=self.waiting,
            share=round(self.share, 4),
            slowdown=round(self.slowdown, 3),
            severity=self.severity,
            work=work_report(self.work),
            median_work=work_report(self.median_work),
            work_ratio=round(r, 3) if (r := self.work_ratio) is not None else None,
            imbalance=self.imbalance,
            new_step_ms=round(self.after_ms, 3),
            noise_band_ms=round(self.noise.band_ms, 3),
            ahead_in_seconds=list(self.slowest),
        )


def work_report(work: Work | None) -> WorkReport | None:
    return WorkReport(**work.to_json()) if work is not None else None


def _severity(share: float) -> Severity | None:
    if share >= T.straggler_critical:
        return "critical"
    if share >= T.straggler_warning:
        return "warning"
    if share >= T.straggler_info:
        return "info"
    return None


def find_straggler(
    ranks: dict[int, RankTimes],
    scale: float = 1.0,
    pipeline: bool = False,
    seconds: Seconds | None = None,
    host: bool = False,
    gpu: bool = False,
) -> Straggler | None:
    """The rank the others wait for, if the job model holds it (`scale`: the thresholds'
    factor; the straggler in force keeps its verdict at x0.8, at its lowest band). `pipeline`:
    the ranks are a pipeline's stages (T.straggler_pipeline is the lowest band). `seconds`: each
    rank's per-second figures over the window (the noise band, the slowest in most seconds);
    `host`: a host-bound job, judged on host figures only. Whether it was slower before the
    window too is its persistence (persistence.py: chronic or one-off), said, not a gate: a rank
    that slows is named within the window."""
    judged = {r: host_view(t) if host else t for r, t in ranks.items() if t.steps >= T.min_steps}
    if len(judged) < 2:
        return None
    slow = min(judged, key=lambda r: (judged[r].comm_ms, -judged[r].busy_ms))
    floor = judged[slow].comm_ms
    others = [t for r, t in judged.items() if r != slow]
    wait = median(t.comm_ms - floor for t in others)
    step = median(t.step_ms for t in judged.values())
    least = T.straggler_pipeline if pipeline else T.straggler_info
    if step <= 0 or wait < T.straggler_min_ms * scale or wait / step < least * scale:
        return None
    s = judged[slow]
    points = own_points(seconds or {}, judged, host)
    noise = measure_noise(points, slow, step)
    margin = T.straggler_margin if noise.measured else 1.0  # a measured band is one deviation
    if s.busy_ms - median(t.busy_ms for t in others) <= margin * noise.band_ms * scale:
        return None  # within what identical ranks vary here
    excess = {p: s.cost(p) - median(t.cost(p) for t in others) for p in OWN_PHASES}
    if sum(max(0.0, x) for x in excess.values()) < T.straggler_covered * wait * scale:
        return None  # its own phases do not account for the others' wait
    hits, judged_s = ahead_seconds(points, slow, noise.band_ms * scale)
    if judged_s >= T.noise_seconds and hits < T.straggler_persistent * scale * judged_s:
        return None  # ahead of the others in a few seconds only: a spike, not a straggler
    severity = (
        _severity(wait / step) or "info"
    )  # hysteresis keeps the verdict; it does not raise the severity
    phase = max(excess, key=lambda p: excess[p])
    if excess[phase] < T.straggler_explained * wait:
        phase = ""  # no one of its measured phases accounts for the others' wait
    med = median(t.cost(phase) for t in others) if phase else 0.0
    cost = s.cost(phase) if phase else 0.0
    # the what-if: the slowest other rank's own time and the collectives' own time
    after = max(t.busy_ms for t in others) + floor
    return Straggler(
        slow, phase, cost, med, wait, step, len(others), severity, s.work, median_work(others),
        after, noise, (hits, judged_s), gpu or any(t.sampled for t in ranks.values()), host,
    )  # fmt: skip


def median_work(ranks: list[RankTimes]) -> Work | None:
    """The median rank's work a step (each figure's median), over the ranks whose batches were seen."""
    seen = [t.work for t in ranks if t.work is not None]
    if not seen:
        return None
    return Work(median(w.samples for w in seen), median(w.tokens for w in seen), median(w.seq for w in seen))


def work_line(s: Straggler) -> str | None:
    """More work or the same work, in words; None where its batches were not seen."""
    r, w, m = s.work_ratio, s.work, s.median_work
    if r is None or w is None or m is None:
        return None
    what = "tokens" if w.tokens and m.tokens else "samples"
    if s.imbalance:
        seq = f" (sequence {w.seq:.0f} vs {m.seq:.0f})" if w.seq and m.seq and w.seq != m.seq else ""
        return f"rank {s.rank} processes {r:.1f}x the median rank's {what}{seq}: balance the packing"
    if abs(r - 1.0) <= T.work_same:
        where = "its GPU or its host" if s.gpu and not s.host_only else "its host"
        return f"rank {s.rank} is slower at the same work ({what} within {pct(T.work_same, 0)}): {where}"
    return None


def _slowdown_line(s: Straggler) -> tuple[str, ...]:
    """How much slower the job runs for it, from 1.1x up (under that it is not worth a line)."""
    x = s.step_ms / s.after_ms if s.after_ms > 0 else T.speedup_cap + 1
    if x < T.slowdown_shown:
        return ()
    return (f"the job runs {times_words(x)} slower than it would without rank {s.rank}'s excess",)


def straggler_finding(s: Straggler) -> Finding:
    """The job verdict: the rank, the phase, what it costs."""
    if s.phase:
        what = f"rank {s.rank}: {PHASE_WORDS[s.phase]} {s.phase_ms:.1f} ms vs {s.median_ms:.1f} ms median"
    else:
        what = f"rank {s.rank} is late to every collective: its extra time is spread over its phases, none alone explains it"
    work = work_line(s)
    evidence = (
        *((work, what) if s.imbalance and work else (what,)),
        f"{'the other rank waits' if s.waiting == 1 else f'the other {s.waiting} ranks wait'} "
        f"{s.wait_ms:.1f} ms a step for it in "
        f"collectives: {pct(s.share, 0)} of the {s.step_ms:.1f} ms step",
        *_slowdown_line(s),
        *((work,) if work and not s.imbalance else ()),
        confidence(s.noise, s.wait_ms >= 2 * s.noise.band_ms, s.slowest),
    )
    advice = ADVICE.get(s.phase, ("compare its host and GPU (GPU · Host tab) with the others'",))
    if s.imbalance:
        advice = WORK_ADVICE
    return Finding(
        "work-imbalance" if s.imbalance else "straggler",
        s.severity,
        s.share,
        evidence,
        advice,
        what_if(f"rank {s.rank} at the others' pace", s.step_ms, s.after_ms, s.noise.band_ms),
    )


@dataclass(frozen=True)
class Scaling:
    """Where the job's step goes, rank by rank, against the step time it actually runs at."""

    step_ms: float  # the job's step time (median over ranks)
    compute_ms: float  # the median rank's forward + backward + optimizer
    comm_ms: float  # the collectives' own time: the least any rank waits
    straggler_wait_ms: float  # the median rank's wait beyond that: waiting for the slowest
    baseline_ms: float | None = None  # a 1-rank step time, where one was given

    @property
    def efficiency(self) -> float:
        """Compute share of the job's step (1.0: no time lost to data, communication or waiting)."""
        return min(1.0, self.compute_ms / self.step_ms) if self.step_ms > 0 else 0.0

    @property
    def vs_baseline(self) -> float | None:
        """1-rank step time / job step time (weak scaling: the same batch per rank)."""
        if self.baseline_ms is None or self.step_ms <= 0:
            return None
        return self.baseline_ms / self.step_ms

    def to_report(self) -> ScalingReport:
        def share(x: float) -> float:
            return round(x / self.step_ms, 4) if self.step_ms > 0 else 0.0

        vs = self.vs_baseline
        return ScalingReport(
            step_ms=round(self.step_ms, 3),
            compute_ms=round(self.compute_ms, 3),
            efficiency=round(self.efficiency, 4),
            lost_to_communication=share(self.comm_ms),
            lost_to_waiting=share(self.straggler_wait_ms),
            lost_to_other=share(
                max(0.0, self.step_ms - self.compute_ms - self.comm_ms - self.straggler_wait_ms)
            ),
            baseline_ms=self.baseline_ms,
            vs_baseline=round(vs, 4) if vs is not None else None,
        )

    def to_json(self) -> dict[str, object]:
        return msgspec.to_builtins(self.to_report())


def scaling(ranks: dict[int, RankTimes], baseline_ms: float | None = None) -> Scaling | None:
    judged = [t for t in ranks.values() if t.steps >= T.min_steps]
    if not judged:
        return None
    step = median(t.step_ms for t in judged)
    compute = median(sum(t.cost(p) for p in ("forward", "backward", "optimizer")) for t in judged)
    floor = min(t.comm_ms for t in judged)
    wait = median(t.comm_ms for t in judged) - floor
    return Scaling(step, compute, floor, wait, baseline_ms)


def rule_communication(
    ranks: dict[int, RankTimes], step_ms: float, scale: float = 1.0, bubble: dict[int, float] | None = None
) -> Finding | None:
    """Every rank waits in collectives (no one rank to blame): bandwidth, bucket sizes, overlap.
    `bubble`: each pipeline rank's wait for its neighbour stages, not counted here (bubble.py)."""
    judged = {r: t for r, t in ranks.items() if t.steps >= T.min_steps}
    if len(judged) < 2 or step_ms <= 0:
        return None
    less = bubble or {}
    floor = max(0.0, min(t.comm_ms - less.get(r, 0.0) for r, t in judged.items()))
    share = floor / step_ms
    if share < T.input_moderate * scale:
        return None
    severity = "critical" if share >= T.input_severe else "warning" if share >= T.input_high else "info"
    evidence = (
        f"every rank waits at least {floor:.1f} ms a step in collectives ({pct(share, 0)} of the "
        f"{step_ms:.1f} ms step) that its compute did not hide",
    )
    advice = (
        "larger DDP buckets (bucket_cap_mb) or gradient accumulation: fewer, larger all-reduces",
        "bf16 gradients (a DDP comm hook) halve the bytes; check the interconnect (NVLink/IB)",
    )
    upside = what_if("hiding the collectives behind compute", step_ms, step_ms - floor)
    return Finding("communication", severity, share, evidence, advice, upside)
