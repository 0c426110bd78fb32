"""Phase sampling: which steps have their phases timed. Timing a step's phases costs far more
than ending it (docs/benchmarks.md), so on steps shorter than FULL_STEP_NS only about one in
FULL_STEP_NS / step time is timed, drawn at random; every step's end and wall time are still
logged. The plan is drawn at the probe's housekeeping (hooks/probe.py), a base of whose `Probe`
this is; the boundary reads it as `untimed = plan[left]`."""

from __future__ import annotations

import random
from collections.abc import Callable
from time import perf_counter_ns

PERIOD = 64  # steps between the boundary's housekeeping (sampling, shedding) when nothing is due
# steps at least this long: every one timed (1 in 4 at 5 ms, 1 in 10 at 2 ms). A timed step costs the
# training thread ~20 us of cold-cache work on an H200 host (the paired benchmark, all timed vs all
# untimed: docs/benchmarks.md): at most 50 timed steps a second keep that near 0.1% of the wall clock
FULL_STEP_NS = 20_000_000
# a timed backward of a distributed run also arms the collective-wait callback (hooks/collectives.py),
# which costs about as much again: there, at most ~33 timed steps a second (its job tests and
# relays' figures were measured at this value)
COMM_FULL_STEP_NS = 30_000_000
MAX_ONE_IN = 64  # 1 step in 64 timed at least (steps of 0.16 ms or less)
# values of `untimed` (0: a timed step); timed.py tests `>= UNTIMED`
UNTIMED = 2
WAKE = 1  # set by the agent thread: time again from the next root forward (an eval loop?)
_rand = random.Random().random  # our own generator: the user's seeded one is theirs
ALL_TIMED = [0] * (PERIOD + 1)  # `plan` while every step is timed


class NoneTimed:
    """`plan` of a disabled probe, whose `left` is huge: any step, 0 (the wrappers do nothing)."""

    def __getitem__(self, index: int) -> int:
        return 0


class PhaseSampling:
    """`Probe`'s plan of timed steps; the fields are the probe's (its __slots__)."""

    __slots__ = ()
    plan: list[int]
    untimed: int
    phase_every: int
    comm: bool
    explicit: bool
    opt_fast: bool
    on_step: Callable[[], None] | None
    _hk_ns: int
    _hk_steps: int

    def _one_in_timed(self, steps: int) -> int:
        """About 1 step in how many to time, from the mean step time since the last
        housekeeping (or as `phase_every` says)."""
        now = perf_counter_ns()
        n, last = steps - self._hk_steps, self._hk_ns
        self._hk_ns, self._hk_steps = now, steps
        if self.phase_every or n <= 0 or not last:
            return self.phase_every or 1
        full = COMM_FULL_STEP_NS if self.comm else FULL_STEP_NS
        return min(MAX_ONE_IN, -(-full * n // max(1, now - last)))

    def _plan(self, one_in: int, batch: int) -> None:
        """Which of the next `batch` steps are timed: each with chance 1 / `one_in`, drawn
        independently (a loader's periodic stall does not alias with it); the first now."""
        if one_in <= 1 or self.explicit or not self.opt_fast or self.on_step is not None:
            self.plan = ALL_TIMED
            return
        p = 1.0 / one_in
        self.plan = plan = [0 if _rand() < p else UNTIMED for _ in range(batch)]
        self.untimed = plan[0]  # then plan[batch - 1] .. plan[1], as `left` counts down
