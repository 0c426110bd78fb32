"""What the Ranks panel shows: one row per rank against the median rank, and a strip over time.

Rows are built from each rank's buckets (rank_stats.py), so the cost of a refresh grows with the
number of ranks, not with steps. The strip is the rank's own time a step (its step less its
collective wait) against the median rank's in each 10 s (or, past an hour, 5 min) bucket: a rank
that slows after an hour rises in its strip while the others stay flat. Pure: no textual.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from statistics import median
from typing import NamedTuple

from torchtop.monitor.model.job_state import JobState, Member
from torchtop.monitor.model.rank_stats import RankTimes
from torchtop.monitor.model.relayed import relay_status

STRIP_CELLS = 24  # buckets in a rank's strip
TOP_K = 5  # slowest ranks listed first when the job has many
MANY = 12  # ranks beyond which the slowest go on top and ranks are grouped by node
STRIP_LEVELS = (0.9, 1.05, 1.15, 1.3, 1.5, 1.75, 2.0)  # own time / median: ▁ .. █
BLOCKS = "▁▂▃▄▅▆▇█"
COLUMNS = ("step", "data", "fwd+bwd", "optim", "comm", "own")


class RankRow(NamedTuple):
    rank: int
    key: str
    node: str
    status: str  # connected / stale / agent gone / waiting
    figures: dict[str, float]  # ms a step by COLUMNS
    mem_peak: int  # bytes: CUDA peak allocated, else the process RSS; 0 unknown
    gpu_util: float | None  # NVML percent, None unknown
    strip: str  # one block a bucket, oldest first
    steps: int


@dataclass
class RanksView:
    rows: list[RankRow] = field(default_factory=list[RankRow])  # by rank
    median: dict[str, float] = field(default_factory=dict[str, float])  # the median rank's figures
    slowest: list[int] = field(default_factory=list[int])  # ranks, slowest first (by own time)
    nodes: dict[str, list[int]] = field(default_factory=dict[str, list[int]])  # node -> its ranks
    bucket_s: int = 10


def figures(t: RankTimes) -> dict[str, float]:
    return {
        "step": t.step_ms,
        "data": t.cost("data"),
        "fwd+bwd": t.cost("forward") + t.cost("backward"),
        "optim": t.cost("optimizer"),
        "comm": t.comm_ms,
        "own": t.busy_ms,
    }


def _telemetry(m: Member) -> tuple[int, float | None]:
    tel = m.state.telemetry
    if tel is None:
        return 0, None
    mem = tel.memory[0] if tel.memory else None
    peak = m.state.peak_window.get(mem.device, mem.peak_allocated) if mem else 0
    if mem is None and tel.host is not None:
        peak = tel.host.proc_rss
    gpu = next(
        (g for g in tel.gpus if mem is not None and g.index == mem.device), tel.gpus[0] if tel.gpus else None
    )
    return peak, gpu.util_gpu if gpu is not None else None


def block(ratio: float) -> str:
    """The strip's block for own time / median own time."""
    return BLOCKS[bisect_right(STRIP_LEVELS, ratio)]  # the levels it reaches (they are sorted)


def ranks_view(
    job: JobState, seconds: float, end: float | None, now: float, cells: int = STRIP_CELLS
) -> RanksView:
    members = job.ranked()
    view = RanksView()
    if not members:
        return view
    times = {m.key: m.stats.window(seconds, end) for m in members}
    span = max(
        (m.stats.levels[0][-1].t - m.stats.levels[1][0].t for m in members if m.stats.levels[1]), default=0
    )
    view.bucket_s = 10 if span <= cells * 10 else 300
    series = {m.key: m.stats.busy_series(cells, view.bucket_s) for m in members}  # None: no steps
    by_t: dict[int, list[float]] = {}
    for pts in series.values():
        for t, busy in pts:
            if busy is not None:
                by_t.setdefault(t, []).append(busy)
    med_t = {t: median(v) for t, v in by_t.items()}
    for m in members:
        t = times[m.key]
        strip = "".join(
            block(busy / med) if busy is not None and (med := med_t.get(ts, 0)) > 0 else " "
            for ts, busy in series[m.key]
        )
        peak, util = _telemetry(m)
        status = "refused" if m.refused else relay_status(job, m, now) or m.state.connection(now)
        view.rows.append(RankRow(m.rank, m.key, m.node, status, figures(t), peak, util, strip, t.steps))
        view.nodes.setdefault(m.node, []).append(m.rank)
    running = [r for r in view.rows if r.steps and r.status != "agent gone"]
    if running:
        view.median = {c: median(r.figures[c] for r in running) for c in COLUMNS}
        view.slowest = [r.rank for r in sorted(running, key=lambda r: -r.figures["own"])]
    return view


def deviation(value: float, med: float) -> str:
    """ "hot" (>= 1.5x the median and 1 ms more), "warm" (>= 1.2x), or ""."""
    if med <= 0:
        return "hot" if value >= 1.0 else ""
    if value >= 1.5 * med and value - med >= 1.0:
        return "hot"
    if value >= 1.2 * med and value - med >= 0.5:
        return "warm"
    return ""
