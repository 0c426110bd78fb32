"""The job-scope rules in the catalogue's shape, `(JobFacts, scale) -> Finding | None`: the
straggler, the pipeline bubble and the job-wide collective wait, over every rank's figures
(straggler.py, bubble.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from torchtop.monitor.diagnosis.bubble import bubble_line
from torchtop.monitor.diagnosis.facts import THRESHOLDS as T
from torchtop.monitor.diagnosis.facts import Finding
from torchtop.monitor.diagnosis.straggler import find_straggler, straggler_finding
from torchtop.monitor.diagnosis.straggler import rule_communication as _communication
from torchtop.monitor.model.fmt import pct
from torchtop.monitor.model.rank_stats import RankTimes


@dataclass(frozen=True)
class JobFacts:
    """What the job rules look at: each running rank's figures over the same window, and the
    verdict of the job's aggregate steps (the mean rank)."""

    times: dict[int, RankTimes]
    base_kind: str
    bubble: dict[int, float] = field(default_factory=dict[int, float])  # pipeline ranks' bubble, ms a step

    @property
    def step_ms(self) -> float:
        """The median rank's step time (0: no rank)."""
        steps = sorted(t.step_ms for t in self.times.values())
        return steps[len(steps) // 2] if steps else 0.0


def rule_straggler(j: JobFacts, scale: float = 1.0) -> Finding | None:
    """A rank slower at the same work (its GPU or its host)."""
    found = find_straggler(j.times, scale, bool(j.bubble))
    return straggler_finding(found) if found is not None and not found.imbalance else None


def rule_work_imbalance(j: JobFacts, scale: float = 1.0) -> Finding | None:
    """A rank given more work a step than the others (uneven packing, a heavier batch)."""
    found = find_straggler(j.times, scale, bool(j.bubble))
    return straggler_finding(found) if found is not None and found.imbalance else None


def rule_pipeline_bubble(j: JobFacts, scale: float = 1.0) -> Finding | None:
    """Every pipeline stage idles a real share of its step waiting for its neighbours (no stage
    slower than the others: that is the straggler, found first): the schedule's fill and drain."""
    shares = {
        r: b / j.times[r].step_ms for r, b in j.bubble.items() if r in j.times and j.times[r].step_ms > 0
    }
    if len(shares) < 2:
        return None
    least = min(shares, key=lambda r: shares[r])
    share = shares[least]
    if share < T.input_moderate * scale:
        return None
    severity = "critical" if share >= T.input_severe else "warning" if share >= T.input_high else "info"
    worst = max(shares, key=lambda r: shares[r])
    evidence = (
        f"every pipeline stage waits at least {pct(share, 0)} of its step for its neighbour stages' send/recv",
        bubble_line(worst, j.bubble[worst], j.times[worst].step_ms),
    )
    advice = (
        "more micro-batches a step (n_microbatches) shrink the fill and drain: the bubble is about "
        "(stages - 1) / (micro-batches + stages - 1) of a GPipe or 1F1B step",
        "an interleaved or zero-bubble schedule (ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble)",
    )
    return Finding("pipeline-bubble", severity, share, evidence, advice, None)


def rule_communication(j: JobFacts, scale: float = 1.0) -> Finding | None:
    """Only over a healthy aggregate: a data-loading job is that, not its collectives; a
    pipeline's wait for its neighbour stages is its bubble, not collective wait."""
    if j.base_kind not in ("compute", "unknown"):
        return None
    return _communication(j.times, j.step_ms, scale, j.bubble)
