"""What the monitor keeps of an agent's `wire.Why`: stack samples, sync detection, the FLOP count.

Pure data, fed by RunState.apply_batch. Samples keep their time on the wall clock (the agent's
perf_counter stamp + the batch's wall offset), like the steps, so they fold onto the steps they
fell in (model/hotspots.py). The step the FLOPs were counted over ran under a dispatch mode,
and the step after it paid for leaving it: both stay in the run's steps (their count, the
replay's numbering) and out of every figure over a window (`excluded`, RunState.window).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from torchtop.contract.wire import FlopInfo, StackSample, SyncInfo, Why
from torchtop.monitor.model.steps import StepRecord

MAX_SAMPLES = 12_000  # ten minutes at 20 Hz


@dataclass
class WhyState:
    samples: deque[tuple[float, StackSample]] = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))
    stack_hz: float = 0.0
    stack_cost_us: float | None = None
    sync: SyncInfo | None = None
    flops: FlopInfo | None = None
    flop_span: tuple[float, float] | None = None  # wall clock: the counted step and the exit's cost
    params: int | None = None  # the run's root modules' parameters (a pipeline stage's own)

    def apply(self, why: Why, wall_offset: float) -> None:
        """Take one batch's `why`."""
        last = self.samples[-1][0] if self.samples else float("-inf")
        for s in why.stacks:
            t = s.t / 1e9 + wall_offset
            if t > last:  # a catch-up repeats samples already held
                self.samples.append((t, s))
                last = t
        self.stack_hz = why.stack_hz
        self.stack_cost_us = why.stack_cost_us
        if why.sync is not None:
            self.sync = why.sync
        if why.params is not None and why.params >= 0:
            self.params = why.params
        if why.flops is not None:
            self.flops = why.flops
            f = why.flops
            if f.state == "done" and f.t1 > f.t0 > 0 and self.flop_span is None:
                self.flop_span = (f.t0 / 1e9 + wall_offset, f.t1 / 1e9 + wall_offset)

    def excluded(self, s: StepRecord) -> bool:
        """A step that overlaps the FLOP count (the counted step, and the next one)."""
        span = self.flop_span
        return span is not None and s.t0 < span[1] and s.t0 + s.wall_ns / 1e9 > span[0]
