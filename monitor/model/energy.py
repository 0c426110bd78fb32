"""What a run's steps cost in energy, from cumulative counters: NVML's total energy per GPU
(mJ since the driver loaded), RAPL's CPU packages (agent/telemetry/rapl.py). Pure.

The counter is read a few times a second, never at a step's edges: between two readings it is
taken as linear (the mean power of that interval), so the energy of a span is the counter's rise
over the part of the span the readings cover, scaled to the whole span at that part's mean power.
A pair whose counter falls (a driver reload, a reset, a wrap not undone) is dropped, with its time.
Joules a step = the span's energy / the steps counted in it; a sample, a token: over the steps'
mean batch where the agent saw it (StepRecord.samples / tokens; 0: not seen).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import msgspec

from torchtop.monitor.model.state import Point, Summary
from torchtop.monitor.model.steps import StepRecord

CPU = "cpu"  # RAPL's source name: the machine's CPU packages, shared by every rank on the node


class Reading(NamedTuple):
    time: float  # agent clock (unix seconds), the steps' clock
    joules: float  # the counter, cumulative


class SourceEnergy(msgspec.Struct, omit_defaults=True):
    """One counter's figures over the steps' span."""

    joules: float  # over the whole span (its covered part's mean power times the span)
    watts: float
    covered: float  # share of the span between two readings of a rising counter (0..1)


class Energy(msgspec.Struct, omit_defaults=True):
    """Energy over a list of steps: per source, and their total. `from_` names what the totals
    add: the GPUs where any has a counter, else the CPU packages (RAPL)."""

    span_s: float = 0.0
    steps: int = 0
    from_: str = msgspec.field(default="", name="from")  # "gpu" | "cpu"
    joules: float | None = None
    watts: float | None = None
    joules_per_step: float | None = None
    joules_per_sample: float | None = None
    joules_per_token: float | None = None
    sources: dict[str, SourceEnergy] = {}


def span_energy(readings: Sequence[Reading], start: float, end: float) -> SourceEnergy | None:
    """The counter's energy over [start, end]; None where no pair of readings covers any of it."""
    if not end > start:
        return None
    rise = covered = 0.0
    for a, b in zip(readings, readings[1:]):
        dt, dj = b.time - a.time, b.joules - a.joules
        if dt <= 0 or dj < 0:
            continue  # out of order, or the counter was reset / wrapped: this pair says nothing
        lo, hi = max(a.time, start), min(b.time, end)
        if hi > lo:
            rise += dj * (hi - lo) / dt
            covered += hi - lo
    if covered <= 0:
        return None
    watts = rise / covered
    span = end - start
    return SourceEnergy(joules=watts * span, watts=watts, covered=min(1.0, covered / span))


def by_source(points: Iterable[tuple[float, dict[str, float] | None]]) -> dict[str, list[Reading]]:
    """(time, counters) samples, e.g. RunState.points' (time, energy), as readings per source in
    time order."""
    out: dict[str, list[Reading]] = {}
    for t, counters in points:
        for name, joules in (counters or {}).items():
            out.setdefault(name, []).append(Reading(t, joules))
    for series in out.values():
        series.sort(key=lambda r: r.time)
    return out


def _per(joules_per_step: float, counts: list[int]) -> float | None:
    seen = [c for c in counts if c > 0]
    return joules_per_step / (sum(seen) / len(seen)) if seen else None


def window_energy(
    points: Iterable[Point], steps: Sequence[StepRecord], summary: Summary | None = None
) -> Energy | None:
    """step_energy over RunState.points' counters; where `steps` is `summary`'s kept-whole steps,
    over the summary's span and every step it counted (a thinned window keeps only some whole)."""
    readings = by_source((p.time, p.energy) for p in points if p.energy)
    if summary is not None and steps is summary.in_full and summary.steps > 0 and summary.covered_s > 0:
        return step_energy(readings, steps, summary.steps, (summary.start, summary.start + summary.covered_s))
    return step_energy(readings, steps)


def step_energy(
    readings: dict[str, list[Reading]],
    steps: Sequence[StepRecord],
    count: int | None = None,
    span: tuple[float, float] | None = None,
) -> Energy | None:
    """Joules a step / sample / token and mean watts over `steps` (in time order); `count` and
    `span`: the steps counted and the time they cover where `steps` holds only some of them (a
    thinned window). None: no step, or no counter covers the span."""
    if not steps or not readings:
        return None
    start, end = span if span is not None else (steps[0].t0, max(s.t0 + s.wall_ns / 1e9 for s in steps))
    n = count if count is not None and count > 0 else len(steps)
    sources = {
        name: e for name, r in sorted(readings.items()) if (e := span_energy(r, start, end)) is not None
    }
    if not sources:
        return None
    gpus = [e for name, e in sources.items() if name != CPU]
    summed = gpus or [sources[CPU]]
    joules = sum(e.joules for e in summed)
    per_step = joules / n
    return Energy(
        span_s=end - start,
        steps=n,
        from_="gpu" if gpus else "cpu",
        joules=joules,
        watts=sum(e.watts for e in summed),
        joules_per_step=per_step,
        joules_per_sample=_per(per_step, [s.samples for s in steps]),
        joules_per_token=_per(per_step, [s.tokens for s in steps]),
        sources=sources,
    )


def rounded(e: Energy | None) -> Energy | None:
    """The figures as a report shows them (4 significant digits of a joule, 0.1 W)."""
    if e is None:
        return None

    def r(x: float | None) -> float | None:
        return None if x is None else float(f"{x:.4g}")

    return msgspec.structs.replace(
        e,
        span_s=round(e.span_s, 3),
        joules=r(e.joules),
        watts=r(e.watts),
        joules_per_step=r(e.joules_per_step),
        joules_per_sample=r(e.joules_per_sample),
        joules_per_token=r(e.joules_per_token),
        sources={
            k: SourceEnergy(
                joules=float(f"{v.joules:.4g}"), watts=round(v.watts, 1), covered=round(v.covered, 3)
            )
            for k, v in e.sources.items()
        },
    )


def job_energy(ranks: dict[int, tuple[str, Energy | None]]) -> Energy | None:
    """The job's energy from its ranks' (node, energy): their GPUs summed; on CPU, one rank's RAPL
    a node (every rank on a node reads the same packages). None: no rank knows its energy."""
    known = [(node, e) for node, e in ranks.values() if e is not None and e.joules is not None]
    if not known:
        return None
    gpu = [e for _, e in known if e.from_ == "gpu"]
    if gpu:
        chosen = gpu
    else:
        per_node: dict[str, Energy] = {}
        for node, e in known:
            per_node.setdefault(node, e)
        chosen = list(per_node.values())
    joules = sum(e.joules or 0.0 for e in chosen)
    watts = sum(e.watts or 0.0 for e in chosen)
    # a job step is every rank's step: its energy is the ranks' energy a step, summed
    per_step = [e.joules_per_step for e in chosen]
    per_sample = [e.joules_per_sample for e in chosen]
    per_token = [e.joules_per_token for e in chosen]
    return Energy(
        span_s=max(e.span_s for e in chosen),
        steps=max(e.steps for e in chosen),
        from_="gpu" if gpu else "cpu",
        joules=joules,
        watts=watts,
        joules_per_step=sum(x for x in per_step if x is not None) if None not in per_step else None,
        # a rank's samples are its share of the job's batch: a job's sample costs every rank's
        # joules a step over the job's batch (the ranks' batches added)
        joules_per_sample=_job_per(chosen, per_sample),
        joules_per_token=_job_per(chosen, per_token),
    )


def _job_per(chosen: list[Energy], per: list[float | None]) -> float | None:
    """Joules a job's sample (token): every rank's joules a step over the ranks' batches."""
    if any(x is None for x in per) or not chosen:
        return None
    step_joules = [e.joules_per_step or 0.0 for e in chosen]
    batches = [sj / x for sj, x in zip(step_joules, per) if x]
    return sum(step_joules) / sum(batches) if batches else None
