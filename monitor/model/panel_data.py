"""What the marks, memory and host panels show, reduced from RunState. Pure: no textual, no zmq.

Each function is bounded (a fixed number of steps or points), so the TUI can call them at its
refresh rate without the cost growing with the run's length.
"""

from __future__ import annotations

from collections.abc import Reversible, Sequence
from itertools import islice
from typing import NamedTuple

from torchtop.contract.wire import HostSample, WorkerSample
from torchtop.monitor.model.fmt import Level
from torchtop.monitor.model.state import Point
from torchtop.monitor.model.steps import StepRecord

MARK_NAMES = 4  # most user marks shown
MARK_DEPTH = 2000  # most recent steps searched for marks
PLOT_S = 300.0  # the memory plot's time span
PLOT_POINTS = 240  # most points handed to the plot (it is at most a terminal wide)
GIB = 2**30
MIB = 2**20


class MarkRow(NamedTuple):
    name: str
    latest: float
    series: list[float]  # oldest first


def mark_rows(
    steps: Reversible[StepRecord], names: int = MARK_NAMES, depth: int = MARK_DEPTH
) -> list[MarkRow]:
    """User marks (torchtop.agent.mark) of the last `depth` steps: latest value and history per name.

    When more than `names` names exist, the ones recorded most often win; rows are sorted by
    name so they keep their place on screen.
    """
    series: dict[str, list[float]] = {}
    for s in islice(reversed(steps), depth):
        for name, value in s.marks.items():
            series.setdefault(name, []).append(value)
    if not series:
        return []
    kept = sorted(series, key=lambda n: -len(series[n]))[:names]
    return [MarkRow(n, series[n][0], series[n][::-1]) for n in sorted(kept)]


class PlotSeries(NamedTuple):
    """A memory plot: x in seconds before the latest point, y per line in `unit`."""

    xs: list[float]
    lines: dict[str, list[float]]
    unit: str
    limit: float  # the device total in `unit` (0: none)


def _scale(top: float) -> tuple[str, float]:
    return ("GiB", GIB) if top >= GIB else ("MiB", MIB)


def memory_series(
    points: Sequence[Point], cuda: bool, device_total: int = 0, width: int = PLOT_POINTS
) -> PlotSeries:
    """Allocated and reserved CUDA memory (or, without CUDA, process RSS) over `points`.

    Points are grouped into at most `width` time buckets, each keeping its highest value: a
    short spike must still show at any zoom.
    """
    if not points:
        return PlotSeries([], {}, "MiB", 0.0)
    names = ("allocated", "reserved") if cuda else ("process RSS",)
    t_end = points[-1].time
    span = max(1e-9, t_end - points[0].time)
    slots: dict[int, list[float]] = {}
    for p in points:
        k = (
            min(width - 1, int((p.time - points[0].time) / span * width))
            if len(points) > width
            else len(slots)
        )
        values = (p.allocated, p.reserved) if cuda else (p.rss,)
        old = slots.get(k)
        slots[k] = list(values) if old is None else [max(a, b) for a, b in zip(old, values)]
    keys = sorted(slots)
    top = max(max(slots[k]) for k in keys)
    unit, div = _scale(max(top, device_total if cuda else 0))
    if len(points) > width:
        xs = [points[0].time - t_end + (k + 0.5) * span / width for k in keys]
    else:
        xs = [p.time - t_end for p in points]
    lines = {name: [slots[k][i] / div for k in keys] for i, name in enumerate(names)}
    return PlotSeries(xs, lines, unit, device_total / div if cuda and device_total else 0.0)


def worker_rows(host: HostSample | None) -> list[WorkerSample]:
    """Child processes, DataLoader workers first, then by CPU use."""
    if host is None:
        return []
    return sorted(host.workers, key=lambda w: (not w.dataloader, -w.cpu_percent, w.pid))


def step_counts(train: Sequence[StepRecord], evals: Sequence[StepRecord]) -> tuple[int, int]:
    """(optimizer steps GradScaler skipped, eval steps) in the window."""
    return sum(s.skipped for s in train), len(evals)


def memory_level(
    fractions: Sequence[float], retry_rate: float, ooms: int, warn: float = 0.8, crit: float = 0.9
) -> Level:
    """The memory panel's colour: the highest share of the device in use, retries and OOMs."""
    worst = max(fractions, default=0.0)
    if worst >= crit or ooms > 0 or retry_rate > 0:
        return "critical"
    if worst >= warn:
        return "warning"
    return "ok"


def y_top(s: PlotSeries) -> float:
    """The plot's top: the device total once use passes half of it (so "full" is at the top),
    else the data's own peak with headroom (so a small run's shape is still visible)."""
    top = max((max(v) for v in s.lines.values() if v), default=0.0)
    if s.limit and top >= 0.5 * s.limit:
        return max(s.limit, top)
    return top * 1.15 if top > 0 else 1.0


def train_number(last: StepRecord, evals: Sequence[StepRecord], evals_total: int) -> int:
    """The newest training step's number among training steps: its index, which counts every
    step the agent cut, less the eval passes counted before it (those after it are in `evals`)."""
    later = sum(1 for e in evals if e.i > last.i)
    return max(0, last.i - max(0, evals_total - later))
