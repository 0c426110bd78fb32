"""Every step of a run, counted at a coarse resolution in bounded memory. Pure: no textual, no zmq.

RunState keeps the last HISTORY steps whole (StepRecords); this keeps count of all of them, in
slots of `width` seconds of agent time (1 s, doubled whenever there are more than MAX_SLOTS):
the training steps that ended in the slot, their wall time, and a log-binned histogram of the
wall times of those seen one by one. Steps are numbered contiguously (StepRecord.i), so a step
never seen (lost with a batch, left out of the agent's thinned history) is still counted, with
its wall time, between the steps around it; the agent's own count of the steps before its
history (wire.StepTally) covers the run from its first step. Counts live in the steps' index
space (eval steps take an index too, and are counted apart).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from torchtop.contract.wire import StepTally
    from torchtop.monitor.model.steps import StepRecord

SLOT_S = 1.0
MAX_SLOTS = 2048  # ~34 minutes at one second a slot, then two seconds, ...
BINS_PER_OCTAVE = 16  # a histogram bin is 4.4% wide: a quantile read from it is within ~2.2%


class Slot:
    """The steps that ended within `width` seconds from `t`. `first`/`last` are (end time, index
    count) milestones: `n` steps had ended by then."""

    __slots__ = (
        "t",
        "steps",
        "evals",
        "wall_ns",
        "seen",
        "hist",
        "first_end",
        "first_n",
        "last_end",
        "last_n",
    )

    def __init__(self, t: float, end: float, n: int) -> None:
        self.t = t
        self.steps = 0  # training steps, seen or not
        self.evals = 0
        self.wall_ns = 0  # the training steps' wall time
        self.seen = 0  # training steps seen one by one: their wall times are in `hist`
        self.hist: dict[int, int] = {}
        self.first_end, self.first_n = end, n
        self.last_end, self.last_n = end, n

    def merge(self, other: Slot) -> None:
        self.steps += other.steps
        self.evals += other.evals
        self.wall_ns += other.wall_ns
        self.seen += other.seen
        for b, k in other.hist.items():
            self.hist[b] = self.hist.get(b, 0) + k
        self.last_end, self.last_n = other.last_end, other.last_n


class Span(NamedTuple):
    """What the slots of a window hold (the slot at its start whole)."""

    steps: int
    evals: int
    wall_ns: int
    seen: int
    hist: dict[int, int]


def wall_bin(wall_ns: int) -> int:
    return int(math.log2(max(wall_ns, 1)) * BINS_PER_OCTAVE)


def quantile_ms(hist: dict[int, int], q: float) -> float:
    """The q-quantile (0..1) of the wall times in `hist`, in ms (the bin's middle)."""
    total = sum(hist.values())
    if not total:
        return 0.0
    rank = q * (total - 1)
    seen = 0
    for b in sorted(hist):
        seen += hist[b]
        if seen > rank:
            return 2 ** ((b + 0.5) / BINS_PER_OCTAVE) / 1e6
    return 0.0


class RunTally:
    """Counts of every step of one run, from the records the monitor replays and the agent's tally."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.slots: deque[Slot] = deque()
        self.width = SLOT_S
        self.last_i = -1  # the newest step index counted
        self.last_end: float | None = None
        self.base: tuple[float, int] | None = None  # (time, index count): where the counting starts

    @property
    def n(self) -> int:
        """Steps (of every kind) counted: the next step's index."""
        return self.last_i + 1

    # -- feeding -------------------------------------------------------------------------------
    def add(self, records: Iterable[StepRecord]) -> None:
        """Replayed steps, oldest first; those counted already are skipped."""
        for s in records:
            if s.i <= self.last_i:
                continue
            end = s.t0 + s.wall_ns / 1e9
            if self.base is None:
                self.base = (s.t0, s.i)
            elif s.i > self.last_i + 1 and self.last_end is not None:
                # never seen: they ran between the last step counted and this one
                missed = s.i - self.last_i - 1
                self._put(max(s.t0, self.last_end), s.i, missed, int((s.t0 - self.last_end) * 1e9), None)
            if s.kind == "train":
                self._put(end, s.i + 1, 1, s.wall_ns, wall_bin(s.wall_ns))
            else:
                self._put(end, s.i + 1, 0, 0, None, evals=1)
            self.last_i, self.last_end = s.i, max(end, self.last_end or end)

    def add_agent(self, tally: StepTally, wall_offset: float, first_index: int | None) -> None:
        """The agent's count of the run's steps (perf_counter ns + `wall_offset` = agent wall clock),
        up to the first step of a snapshot (`first_index`; None: all of it). Its steps between two
        points are counted at the later one, with the time between as their wall time."""
        if self.last_i >= 0 and self.base is not None and self.base[1] == 0:
            return  # counted from the run's first step already
        if self.last_i >= 0:
            self.reset()  # a snapshot reaching further back than what was counted: start over
        prev_end, prev_n = tally.start / 1e9 + wall_offset, 0
        self.base = (prev_end, 0)
        for end_ns, count in zip(tally.ends, tally.counts):
            if first_index is not None and count > first_index:
                break
            end = end_ns / 1e9 + wall_offset
            if count > prev_n:
                self._put(end, count, count - prev_n, int((end - prev_end) * 1e9), None)
                prev_end, prev_n = end, count
        if prev_n:
            self.last_i, self.last_end = prev_n - 1, prev_end

    def _put(self, end: float, n: int, steps: int, wall_ns: int, bin_: int | None, evals: int = 0) -> None:
        t = math.floor(end / self.width) * self.width
        slots = self.slots
        if slots and t <= slots[-1].t:
            slot = slots[-1]
        else:
            slot = Slot(t, end, n)
            slots.append(slot)
            if len(slots) > MAX_SLOTS:
                self._coarsen()
                slot = slots[-1]
        slot.steps += steps
        slot.evals += evals
        slot.wall_ns += max(0, wall_ns)
        slot.last_end, slot.last_n = end, n
        if bin_ is not None:
            slot.seen += 1
            slot.hist[bin_] = slot.hist.get(bin_, 0) + 1

    def _coarsen(self) -> None:
        self.width *= 2
        merged: deque[Slot] = deque()
        for slot in self.slots:
            t = math.floor(slot.t / self.width) * self.width
            if merged and merged[-1].t == t:
                merged[-1].merge(slot)
            else:
                slot.t = t
                merged.append(slot)
        self.slots = merged

    # -- reading -------------------------------------------------------------------------------
    def ended_by(self, h: float) -> int:
        """How many steps (by index) had ended by time `h`: exact at milestones, spread evenly
        between them."""
        base = self.base
        if base is None or h < base[0]:
            return base[1] if base is not None else 0
        later: tuple[float, int] | None = None
        for slot in reversed(self.slots):  # newest first: a window needs the last few
            for point in ((slot.last_end, slot.last_n), (slot.first_end, slot.first_n)):
                if point[0] <= h:
                    return point[1] if later is None else between(point, later, h)
                later = point
        return base[1] if later is None else between(base, later, h)

    def span(self, h: float) -> Span:
        """Sums of the slots that end after `h` (the one holding `h` whole)."""
        steps = evals = wall = seen = 0
        hist: dict[int, int] = {}
        for slot in reversed(self.slots):
            if slot.t + self.width <= h:
                break
            steps += slot.steps
            evals += slot.evals
            wall += slot.wall_ns
            seen += slot.seen
            for b, k in slot.hist.items():
                hist[b] = hist.get(b, 0) + k
        return Span(steps, evals, wall, seen, hist)

    def evals_total(self) -> int:
        """Eval steps counted since the counting started (those before an agent's count: none)."""
        return sum(s.evals for s in self.slots)

    def evals_after(self, h: float, before: float) -> int:
        """Eval steps counted in slots between `h` and `before` (whole slots)."""
        return sum(s.evals for s in self.slots if s.t + self.width > h and s.t < before)


def between(a: tuple[float, int], b: tuple[float, int], h: float) -> int:
    """Steps ended by `h` (a[0] <= h < b[0]): a's count, and those between spread evenly."""
    (ta, na), (tb, nb) = a, b
    if nb <= na or tb <= ta:
        return na
    return na + min(nb - na - 1, int((h - ta) / (tb - ta) * (nb - na)))
