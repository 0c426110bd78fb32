"""What the monitor knows about one run: pure data and arithmetic, no textual, no zmq.

Fed with wire messages (`apply_hello`, `apply_batch`, `apply_snapshot`); read through plain
functions that the TUI, `report` and the diagnosis rules share.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from statistics import median
from typing import NamedTuple

from torchtop.contract.logcodes import PHASES
from torchtop.contract.wire import Batch, Hello, MemoryLow, StepTally, Telemetry
from torchtop.monitor.model.hotspots import stall_phases
from torchtop.monitor.model.steps import StepKind, StepRecord
from torchtop.monitor.model.tally import RunTally, between, quantile_ms
from torchtop.monitor.model.why_state import WhyState

HISTORY = 20_000
STALE_AFTER_S = 3.0


class Link(str, Enum):
    """How the monitor's link to the agent stands (the status line's colour and words)."""

    UNCHOSEN = "choose an agent"
    WAITING = "waiting"  # no batch yet
    CONNECTED = "connected"
    STALE = "stale"  # no batch for STALE_AFTER_S
    GONE = "agent gone"

    def __str__(self) -> str:
        return str(self.value)


class Summary(NamedTuple):
    """A window of a run: every training step counted, and those of them kept whole."""

    steps: int  # training steps that ended in the window, every one counted
    in_full: list[StepRecord]  # those kept whole (phases, marks, device times): the breakdown's
    evals: list[StepRecord]
    covered_s: float  # agent time from the window's first step's start to its last step's end
    start: float  # the agent time the window's first step started (nan with no step)
    stats: dict[str, float]  # step_stats over every step counted (quantiles binned when thinned)

    @property
    def thinned(self) -> bool:
        """Fewer steps kept whole than counted: the breakdown is drawn from a part of them."""
        return self.steps > len(self.in_full)


class Point(NamedTuple):
    """One telemetry sample reduced to what plots, rates and the diagnosis rules need."""

    time: float  # agent clock
    allocated: int  # first CUDA device; 0 on CPU
    reserved: int
    retries: int
    gpu_util: float | None  # NVML percent
    proc_cpu: float | None  # training process CPU percent
    rss: int  # training process resident memory, 0 when unknown
    steps: int | None = None  # training steps the agent had cut when it sampled these
    # cumulative energy counters, joules, by source ("gpu0", "gpu1", "cpu"); None: none known
    energy: dict[str, float] | None = None
    cpu_wait: float | None = None  # percent of the second the training thread waited for a CPU


@dataclass
class RunState:
    hello: Hello | None = None
    run_id: str = ""
    steps: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=HISTORY))
    batches: int = 0
    gaps: int = 0  # batches lost between agent and monitor (sequence numbers skipped)
    dropped: int = 0  # step records the agent's own buffer dropped
    hook_errors: int = 0
    bad_frames: int = 0
    last_error: str = ""
    last_seq: int | None = None
    agent_time: float = 0.0  # the agent's clock at its last batch
    last_batch_at: float | None = None  # monitor's monotonic clock at the last batch
    gone: bool = False
    new_runs: int = 0
    telemetry: Telemetry | None = None  # the latest memory / GPU / host samples
    points: deque[Point] = field(default_factory=lambda: deque(maxlen=HISTORY))
    peak_window: dict[int, int] = field(
        default_factory=dict[int, int]
    )  # per device: highest window peak seen
    # the agent's per-second memory lows from before we joined (a snapshot, a `memory` request)
    memory_lows: list[MemoryLow] = field(default_factory=list[MemoryLow])
    why: WhyState = field(default_factory=WhyState)  # stack samples, sync detection, FLOPs
    tally: RunTally = field(default_factory=RunTally)  # every step counted, the whole run
    bad_requests: int = 0  # what the agent refused (from its batches)
    dropped_requests: int = 0

    # -- feeding -------------------------------------------------------------------------------
    def apply_hello(self, hello: Hello) -> None:
        if self.run_id and hello.run_id != self.run_id:
            self._new_run()
        self.hello = hello
        self.run_id = hello.run_id

    def _new_run(self) -> None:
        self.steps.clear()
        self.points.clear()
        self.memory_lows = []
        self.peak_window.clear()
        self.why = WhyState()
        self.telemetry = None
        self.last_seq = None
        self.tally.reset()
        self.new_runs += 1

    def apply_batch(
        self, batch: Batch, steps: list[StepRecord], now: float, log_errors: int = 0
    ) -> list[StepRecord]:
        """A batch and the steps replayed from its log (`log_errors`: malformed entries skipped);
        returns the steps as held (a stall phase sampling skipped given phases: stall_phases)."""
        if self.run_id and batch.run_id != self.run_id:
            self._new_run()
            self.hello = None
        self.run_id = batch.run_id
        if self.last_seq is not None:
            if batch.seq <= self.last_seq:
                return steps  # already seen (e.g. covered by a snapshot)
            self.gaps += batch.seq - self.last_seq - 1
        self.last_seq = batch.seq
        self.batches += 1
        self.dropped = batch.dropped
        self.hook_errors = batch.hook_errors + log_errors
        self.agent_time = batch.time
        self.bad_requests, self.dropped_requests = batch.bad_requests, batch.dropped_requests
        self.last_batch_at = now
        self.gone = False
        if batch.telemetry is not None:
            self.apply_telemetry(batch.telemetry)
        if batch.why is not None:
            self.why.apply(batch.why, batch.wall_offset)
        steps = stall_phases(steps, self.why.samples)
        last_t0 = self.steps[-1].t0 if self.steps else float("-inf")
        self.steps.extend(s for s in steps if s.t0 > last_t0)  # steps are in order, once
        self.tally.add(steps)
        return steps

    def apply_snapshot(
        self, steps: list[StepRecord], seq: int, tally: StepTally | None = None, wall_offset: float = 0.0
    ) -> None:
        """History from before we joined; batches up to `seq` are then ignored. Where it
        overlaps steps already held, the snapshot's are kept. `tally` (the agent's count of the
        steps before its history) covers the run from its start."""
        if tally is not None:
            self.tally.add_agent(tally, wall_offset, steps[0].i if steps else None)
        self.tally.add(steps)
        if steps:
            first, last = steps[0].t0, steps[-1].t0
            merged = (
                [s for s in self.steps if s.t0 < first] + list(steps) + [s for s in self.steps if s.t0 > last]
            )
        else:
            merged = list(self.steps)
        self.steps = deque(merged, maxlen=self.steps.maxlen)
        if merged:  # the window is measured on the agent's clock: a snapshot advances it too
            self.agent_time = max(self.agent_time, merged[-1].t0 + merged[-1].wall_ns / 1e9)
        if self.last_seq is None or seq > self.last_seq:
            self.last_seq = seq

    def apply_memory(self, lows: list[MemoryLow]) -> None:
        """The agent's memory lows: what the leak rule reads before the live points begin."""
        self.memory_lows = list(lows)

    def apply_telemetry(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        m = telemetry.memory[0] if telemetry.memory else None
        g = telemetry.gpus[0] if telemetry.gpus else None
        h = telemetry.host
        self.points.append(
            Point(
                telemetry.time,
                m.allocated if m else 0,
                m.reserved if m else 0,
                m.alloc_retries if m else 0,
                g.util_gpu if g else None,
                h.proc_cpu if h else None,
                h.proc_rss if h else 0,
                telemetry.steps,
                energy_of(telemetry),
                h.train_wait_percent if h else None,
            )
        )
        for m in telemetry.memory:
            self.peak_window[m.device] = max(self.peak_window.get(m.device, 0), m.window_peak)

    def bad_frame(self, reason: str) -> None:
        self.bad_frames += 1
        self.last_error = reason

    # -- reading -------------------------------------------------------------------------------
    def link(self, now: float) -> Link:
        if self.gone:
            return Link.GONE
        if self.last_batch_at is None:
            return Link.WAITING
        if now - self.last_batch_at > STALE_AFTER_S:
            return Link.STALE
        return Link.CONNECTED

    def connection(self, now: float) -> str:
        """The link in words: `stale (12s)` says for how long."""
        link = self.link(now)
        if link == Link.STALE and self.last_batch_at is not None:
            return f"{link} ({now - self.last_batch_at:.0f}s)"
        return str(link)

    def window(self, seconds: float, kind: StepKind = "train") -> list[StepRecord]:
        """Steps of `kind` that ended in the last `seconds` of the agent's clock (not the two
        the FLOP count slowed: they are not the run's pace)."""
        horizon = self.agent_time - seconds
        excluded = self.why.excluded
        out: list[StepRecord] = []
        for s in reversed(self.steps):
            if s.t0 + s.wall_ns / 1e9 < horizon:
                break
            if s.kind == kind and not excluded(s):
                out.append(s)
        out.reverse()
        return out

    def summary(self, seconds: float) -> Summary:
        """The last `seconds` of agent time (inf: the whole run): every training step counted, and
        the ones kept whole. Counts are exact where whole steps reach past the window's start,
        read from the tally (spread evenly between its points) where they do not."""
        horizon = self.agent_time - seconds
        records: list[StepRecord] = []
        prev = None
        for s in reversed(self.steps):
            if s.t0 + s.wall_ns / 1e9 < horizon:
                prev = s
                break
            records.append(s)
        records.reverse()
        in_full = [s for s in records if s.kind == "train"]
        evals = [s for s in records if s.kind != "train"]
        tally = self.tally
        if records and prev is not None:  # whole steps on both sides of the window's start
            first = records[0]
            before = (prev.t0 + prev.wall_ns / 1e9, prev.i + 1)
            ended = first.i if horizon >= first.t0 else between(before, (first.t0, first.i), horizon)
            evals_before = 0
        elif records:
            ended = min(tally.ended_by(horizon), records[0].i)
            evals_before = tally.evals_after(horizon, records[0].t0)
        else:
            ended = tally.ended_by(horizon)
            evals_before = tally.evals_after(horizon, float("inf"))
        newest = max(tally.n, records[-1].i + 1 if records else 0)
        counted = max(len(in_full), newest - ended - len(evals) - evals_before)
        if evals and not in_full:  # only eval passes seen whole: the unseen numbers are passes too
            counted = 0
        if counted == len(in_full):
            if not in_full:
                return Summary(0, in_full, evals, 0.0, math.nan, step_stats(in_full))
            covered = in_full[-1].t0 + in_full[-1].wall_ns / 1e9 - in_full[0].t0
            return Summary(counted, in_full, evals, covered, in_full[0].t0, step_stats(in_full))
        span = tally.span(horizon)
        start = max(horizon, tally.base[0]) if tally.base is not None else horizon
        covered = max(0.0, (tally.last_end or start) - start)
        stats = {
            "now_ms": in_full[-1].wall_ns / 1e6 if in_full else 0.0,
            "median_ms": quantile_ms(span.hist, 0.5),
            "p90_ms": quantile_ms(span.hist, 0.9),
            "mean_ms": span.wall_ns / span.steps / 1e6 if span.steps else 0.0,
            "steps_per_s": counted / covered if covered > 0 else 0.0,
        }
        return Summary(counted, in_full, evals, covered, start, stats)


def energy_of(telemetry: Telemetry) -> dict[str, float] | None:
    """A sample's cumulative energy counters in joules by source; None when it has none."""
    out = {f"gpu{g.index}": g.energy_mj / 1000.0 for g in telemetry.gpus if g.energy_mj is not None}
    if telemetry.cpu_energy_j is not None:
        out["cpu"] = telemetry.cpu_energy_j
    return out or None


def _pct(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    k = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[k]


def step_stats(steps: list[StepRecord]) -> dict[str, float]:
    """Step time now / median / p90 (ms) and steps per second over `steps`."""
    if not steps:
        return {"now_ms": 0.0, "median_ms": 0.0, "p90_ms": 0.0, "mean_ms": 0.0, "steps_per_s": 0.0}
    walls = [s.wall_ns / 1e6 for s in steps]
    ordered = sorted(walls)
    span = (steps[-1].t0 + steps[-1].wall_ns / 1e9) - steps[0].t0
    return {
        "now_ms": walls[-1],
        "median_ms": median(ordered),
        "p90_ms": _pct(ordered, 0.9),
        "mean_ms": sum(walls) / len(walls),
        "steps_per_s": len(steps) / span if span > 0 else 0.0,
    }


def timed(steps: Iterable[StepRecord]) -> list[StepRecord]:
    """The steps whose phases were timed (on fast steps the agent times a random sample)."""
    return [s for s in steps if s.phases]


def breakdown(steps: Iterable[StepRecord]) -> dict[str, float]:
    """Each phase's share of the timed steps' wall time; the shares sum to 1 (0 with no steps)."""
    totals = dict.fromkeys(PHASES, 0)
    wall = 0
    for s in steps:
        if not s.phases:
            continue  # not timed: its wall time alone says nothing of where it went
        wall += s.wall_ns
        for name in PHASES:
            totals[name] += s.phases.get(name, 0)
    if wall <= 0:
        return dict.fromkeys(PHASES, 0.0)
    return {name: totals[name] / wall for name in PHASES}


def phase_ms(steps: list[StepRecord]) -> dict[str, float]:
    """Mean host milliseconds per step in each phase, over the timed steps."""
    steps = timed(steps)
    if not steps:
        return dict.fromkeys(PHASES, 0.0)
    return {name: sum(s.phases.get(name, 0) for s in steps) / len(steps) / 1e6 for name in PHASES}


def device_ms(steps: list[StepRecord]) -> dict[str, float]:
    """Mean CUDA-event milliseconds per event step, by phase (and `step`); {} on CPU."""
    sampled = [s for s in steps if s.device_ms]
    if not sampled:
        return {}
    keys = sorted({k for s in sampled for k in s.device_ms})
    return {k: sum(s.device_ms.get(k, 0.0) for s in sampled) / len(sampled) for k in keys}


def retry_rate(state: RunState, seconds: float) -> float:
    """Allocator retries per second over the last `seconds` (cudaMalloc failed and was retried)."""
    pts = recent_points(state, seconds)
    if len(pts) < 2:
        return 0.0
    span = pts[-1].time - pts[0].time
    return (pts[-1].retries - pts[0].retries) / span if span > 0 else 0.0


def recent_points(state: RunState, seconds: float) -> list[Point]:
    """Telemetry points of the last `seconds` of agent time, oldest first."""
    if not state.points:
        return []
    horizon = state.points[-1].time - seconds
    out: list[Point] = []
    for p in reversed(state.points):
        if p.time < horizon:
            break
        out.append(p)
    out.reverse()
    return out
