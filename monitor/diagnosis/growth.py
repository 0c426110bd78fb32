"""The leak rule's input: how memory in use between steps grows, per training step.

Each second's low point is the memory held between steps (activations come and go within a
step and would hide a slow leak in noise). A leak grows per step, so the low points are set
against the agent's step count at each sample: a pause (a FLOP-counting step, a checkpoint, a
slow attach) adds seconds but no steps, and does not read as memory settling. Kendall's tau
says how steadily memory rises (noise alone gives ~0), the Theil-Sen slope (the median of the
pairwise slopes) how fast, in bytes a step; both shrug off the odd outlier that a first-and-last
comparison would take at face value. Samples without a step count (an older agent) are placed by
time over the mean step time. Pure: RunState in, `Growth` out.
"""

from __future__ import annotations

from statistics import median

from torchtop.monitor.diagnosis.facts import THRESHOLDS as T
from torchtop.monitor.diagnosis.facts import Growth
from torchtop.monitor.model.state import RunState, recent_points

Sample = tuple[float, int | None, float]  # (unix time, steps cut by then, bytes in use)


def memory_samples(state: RunState, cuda: bool) -> list[Sample]:
    """Memory in use over the leak horizon: the agent's per-second lows until the live points
    begin, then the live points (allocated CUDA memory on CUDA, else the process's RSS)."""
    live = [
        (p.time, p.steps, float(p.allocated if cuda else p.rss))
        for p in recent_points(state, T.leak_horizon_s)
    ]
    lows = [(m.time, m.steps, float(m.allocated if cuda else m.rss)) for m in state.memory_lows]
    end = max(live[-1][0] if live else 0.0, lows[-1][0] if lows else 0.0)
    start = end - T.leak_horizon_s
    first_live = live[0][0] if live else float("inf")
    return [x for x in lows if start <= x[0] < first_live] + [x for x in live if x[0] >= start]


def leak_growth(state: RunState, cuda: bool, step_s: float) -> Growth | None:
    """The growth of memory in use past the run's first `leak_warmup_steps` steps."""
    samples = memory_samples(state, cuda)
    warm = T.leak_warmup_steps
    if samples and all(s is not None for _, s, _ in samples):
        return growth([(t, float(s), v) for t, s, v in samples if s is not None and s >= warm])
    since = _since_warmup(state, step_s)
    if since is None or step_s <= 0:
        return None
    return growth([(t, t / step_s, v) for t, _, v in samples if t >= since])


def _since_warmup(state: RunState, step_s: float) -> float | None:
    """When the run passed `leak_warmup_steps` (estimated from the first step held when that was
    before it); None while it has not."""
    warm = int(T.leak_warmup_steps)
    if not state.steps:
        return None
    first = state.steps[0]
    if first.i >= warm:
        return first.t0 - (first.i - warm) * step_s
    return next((s.t0 for s in state.steps if s.i >= warm), None)


def growth(samples: list[tuple[float, float, float]]) -> Growth | None:
    """The trend of (time, steps, bytes) samples: each second's low point against its steps."""
    buckets: dict[int, tuple[float, float, float]] = {}  # second -> (low, its steps, its time)
    for t, x, v in samples:
        if v <= 0:
            continue
        k = int(t)
        if k not in buckets or v < buckets[k][0]:
            buckets[k] = (v, x, t)
    series = [buckets[k] for k in sorted(buckets)]
    n = len(series)
    if n < 4:
        return None
    fit = _theil_sen(series)
    if fit is None:
        return None
    slope, tau = fit
    recent = _theil_sen(series[-max(4, n // 3) :])
    x0 = series[0][1]
    steps = series[-1][1] - x0
    level = median(v - slope * (x - x0) for v, x, _ in series)  # the line at the first point
    return Growth(
        level,
        level + slope * steps,
        series[-1][2] - series[0][2],
        tau,
        slope,
        n,
        recent[0] if recent else 0.0,
        steps,
    )


def _theil_sen(series: list[tuple[float, float, float]]) -> tuple[float, float] | None:
    """(median pairwise slope, Kendall's tau) of (value, x, time) points in time order."""
    n = len(series)
    concordant = 0
    slopes: list[float] = []
    for i in range(n - 1):
        vi, xi, _ = series[i]
        for vj, xj, _ in series[i + 1 :]:
            if xj > xi:
                concordant += (vj > vi) - (vj < vi)
                slopes.append((vj - vi) / (xj - xi))
    if not slopes:
        return None
    return median(slopes), concordant / (n * (n - 1) / 2)
