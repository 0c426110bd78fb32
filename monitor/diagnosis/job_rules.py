"""The job-scope rules in the catalogue's shape, `(JobFacts, scale) -> Finding | None`: the
straggler and the job-wide collective wait, over every rank's figures (straggler.py)."""

from __future__ import annotations

from dataclasses import dataclass

from torchtop.monitor.diagnosis.facts import Finding
from torchtop.monitor.diagnosis.straggler import find_straggler, straggler_finding
from torchtop.monitor.diagnosis.straggler import rule_communication as _communication
from torchtop.monitor.model.rank_stats import RankTimes


@dataclass(frozen=True)
class JobFacts:
    """What the job rules look at: each running rank's figures over the same window, and the
    verdict of the job's aggregate steps (the mean rank)."""

    times: dict[int, RankTimes]
    base_kind: str

    @property
    def step_ms(self) -> float:
        """The median rank's step time (0: no rank)."""
        steps = sorted(t.step_ms for t in self.times.values())
        return steps[len(steps) // 2] if steps else 0.0


def rule_straggler(j: JobFacts, scale: float = 1.0) -> Finding | None:
    """A rank slower at the same work (its GPU or its host)."""
    found = find_straggler(j.times, scale)
    return straggler_finding(found) if found is not None and not found.imbalance else None


def rule_work_imbalance(j: JobFacts, scale: float = 1.0) -> Finding | None:
    """A rank given more work a step than the others (uneven packing, a heavier batch)."""
    found = find_straggler(j.times, scale)
    return straggler_finding(found) if found is not None and found.imbalance else None


def rule_communication(j: JobFacts, scale: float = 1.0) -> Finding | None:
    """Only over a healthy aggregate: a data-loading job is that, not its collectives."""
    if j.base_kind not in ("compute", "unknown"):
        return None
    return _communication(j.times, j.step_ms, scale)
