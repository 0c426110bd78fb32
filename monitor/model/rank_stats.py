"""One rank's step figures in time buckets, kept as steps arrive: what the job view reads.

A job of 64 ranks at 200 steps/s each sends 12,800 steps a second; recomputing every rank's
10 s window from its steps at each refresh would cost the monitor more than the goal allows. So
each step is added once to the current 1-second bucket (a few list additions); a closed second
is folded into 10-second buckets (kept an hour) and those into 5-minute ones (kept a day). A
window's figures are a sum of buckets, and a rank's strip over time is its buckets' series.
Pure: no textual, no zmq.
"""

from __future__ import annotations

import itertools
import operator
from array import array
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

import msgspec

from torchtop.contract.logcodes import PHASES
from torchtop.contract.relay import SECOND_FIELDS, Second
from torchtop.monitor.model.steps import StepRecord

DEVICE_KEYS = ("h2d", "forward", "backward", "optimizer", "comm", "step")
# the phases in the slots' order: a relay's Second is append-only, so `checkpoint` has the last slot
SLOT_PHASES = tuple(p for p in PHASES if p != "checkpoint")
# the bucket's slots: steps, their wall ns; timed steps, their wall ns, each phase's ns; steps
# with device times, each device key's ms
N, WALL, TN, TWALL = range(4)
PH = 4  # SLOT_PHASES start here
DN = PH + len(SLOT_PHASES)
DEV = DN + 1
WN = DEV + len(DEVICE_KEYS)  # steps whose batch was seen (hooks/work.py), their samples, tokens, sequence
SAMPLES, TOKENS, SEQ = WN + 1, WN + 2, WN + 3
CK = SEQ + 1  # the checkpoint phase's ns, over the timed steps (TN)
SIZE = CK + 1
LEVELS = ((1, 120), (10, 360), (300, 288))  # (bucket seconds, buckets kept): 2 min, 1 h, 1 day
_PHASE_SLOTS = (*((PH + k, name) for k, name in enumerate(SLOT_PHASES)), (CK, "checkpoint"))
_ZEROS = [0.0] * SIZE
_DEVICE_SLOTS = tuple((DEV + k, name) for k, name in enumerate(DEVICE_KEYS))
assert len(SECOND_FIELDS) == SIZE + 1, "a relay's Second (contract/relay.py) is [second, *these slots]"


class Bucket:
    """The sums of the steps that ended within one span of wall-clock seconds."""

    __slots__ = ("t", "v")

    def __init__(self, t: int) -> None:
        self.t = t  # the span's start (unix seconds, a multiple of its width)
        self.v = array("d", _ZEROS)  # 19 doubles, not 19 float objects for each full GC to visit

    def add_step(self, s: StepRecord) -> None:
        v = self.v
        v[N] += 1
        v[WALL] += s.wall_ns
        phases = s.phases
        if phases:
            v[TN] += 1
            v[TWALL] += s.wall_ns
            get = phases.get
            for k, name in _PHASE_SLOTS:
                v[k] += get(name, 0)
        if s.samples:
            v[WN] += 1
            v[SAMPLES] += s.samples
            v[TOKENS] += s.tokens
            v[SEQ] += s.seq
        dev = s.device_ms
        if dev:
            v[DN] += 1
            get = dev.get
            for k, name in _DEVICE_SLOTS:
                v[k] += get(name, 0.0)

    def fold(self, other: Bucket) -> None:
        v, o = self.v, other.v
        for k in range(SIZE):
            v[k] += o[k]

    def second(self) -> Second:
        """This bucket as a relay sends it."""
        return Second(float(self.t), *self.v)


def slots(s: Second) -> list[float]:
    """A relay's second as a bucket's slots (the contract names them in this order)."""
    return list(msgspec.structs.astuple(s)[1:])


class Work(NamedTuple):
    """A rank's mean work a step, from the batches its root forwards were called with."""

    samples: float
    tokens: float  # 0: its batches have no sequence dimension
    seq: float  # mean longest sequence a step

    def to_json(self) -> dict[str, float]:
        return {"samples": round(self.samples, 2), "tokens": round(self.tokens, 2), "seq": round(self.seq, 2)}


class RankTimes(NamedTuple):
    """One rank's mean figures over a window, in ms a step (what the job rules look at)."""

    steps: int
    step_ms: float  # mean wall time of a step
    timed: int  # steps whose phases were timed
    phases: dict[str, float]  # host ms per phase (timed steps), `comm` included
    sampled: int  # steps with CUDA device times
    device: dict[str, float]  # device ms per key (sampled steps)
    work: Work | None = None  # its batches (steps whose batch was seen); None: not seen

    @property
    def comm_ms(self) -> float:
        """Exposed collective wait: the compute stream's (device) where sampled, else the host's."""
        if self.sampled and "comm" in self.device:
            return self.device["comm"]
        return self.phases.get("comm", 0.0)

    @property
    def busy_ms(self) -> float:
        """The rank's own time a step: the step less its collective wait."""
        return max(0.0, self.step_ms - self.comm_ms)

    def cost(self, phase: str) -> float:
        """What `phase` costs this rank a step: device time for GPU work where sampled, host
        time for the data wait and the rest."""
        if self.sampled and phase in ("h2d", "forward", "backward", "optimizer") and phase in self.device:
            return self.device[phase]
        return self.phases.get(phase, 0.0)


EMPTY = RankTimes(0, 0.0, 0, {}, 0, {})


def times_of(v: Sequence[float]) -> RankTimes:
    n, tn, dn = int(v[N]), int(v[TN]), int(v[DN])
    if n == 0:
        return EMPTY
    phases = {name: v[k] / tn / 1e6 for k, name in _PHASE_SLOTS} if tn else {}
    device = {name: v[DEV + k] / dn for k, name in enumerate(DEVICE_KEYS)} if dn else {}
    wn = v[WN]
    work = Work(v[SAMPLES] / wn, v[TOKENS] / wn, v[SEQ] / wn) if wn else None
    return RankTimes(n, v[WALL] / n / 1e6, tn, phases, dn, device, work)


class RankStats:
    """A rank's train steps in buckets of 1 s, 10 s and 5 min (by the wall clock of their end)."""

    def __init__(self) -> None:
        self.levels: list[deque[Bucket]] = [deque(maxlen=keep) for _, keep in LEVELS]
        self.last_t0 = float("-inf")  # steps at or before this were added already
        # a refresh reads the same window 3 times (verdict, head, table): kept until a bucket changes
        self._windows: dict[tuple[float, float | None], RankTimes] = {}
        # by (level, width): the last closed bucket, the buckets, their (t, busy): see _final
        self._closed: dict[tuple[int, int], tuple[Bucket, list[Bucket], list[tuple[int, float | None]]]] = {}

    def add(self, steps: list[StepRecord]) -> None:
        """Train steps in order; ones already added (a snapshot's overlap) are skipped."""
        self._windows.clear()
        secs = self.levels[0]
        cur = secs[-1] if secs else None
        for s in steps:
            if s.kind != "train" or s.t0 <= self.last_t0:
                continue
            self.last_t0 = s.t0
            t = int(s.t0 + s.wall_ns / 1e9)
            if cur is None or t > cur.t:
                if cur is not None:
                    self._roll(cur)
                cur = Bucket(t)
                secs.append(cur)
            cur.add_step(s)  # a step a little out of order (clock) joins the current second

    def put(self, t: int, values: list[float]) -> None:
        """One second's sums as a relay sent them (relay/summary.py; `slots`): the open second
        replaces what it held before; a later second closes it; an earlier one is already folded."""
        if len(values) != SIZE:
            raise ValueError(
                f"a bucket of {len(values)} values, not {SIZE}"
            )  # never stored: window() sums it
        self._windows.clear()
        secs = self.levels[0]
        cur = secs[-1] if secs else None
        if cur is not None and t < cur.t:
            return
        if cur is not None and t == cur.t:
            cur.v = array("d", values)
            return
        if cur is not None:
            self._roll(cur)
        b = Bucket(t)
        b.v = array("d", values)
        secs.append(b)

    def _roll(self, closed: Bucket) -> None:
        """A second closed: fold it into the 10 s and 5 min buckets."""
        for level, (width, _) in zip(self.levels[1:], LEVELS[1:]):
            start = closed.t - closed.t % width
            if not level or level[-1].t != start:
                level.append(Bucket(start))
            level[-1].fold(closed)

    def window(self, seconds: float, end: float | None = None) -> RankTimes:
        """Mean figures over the steps that ended in the last `seconds` before `end` (default:
        the end of the latest step's second), from the finest buckets that reach that far back
        (the open second is only in the finest: it is folded when it closes)."""
        key = (seconds, end)
        got = self._windows.get(key)
        if got is None:
            got = self._windows[key] = self._window(seconds, end)
        return got

    def _window(self, seconds: float, end: float | None) -> RankTimes:
        secs = self.levels[0]
        if not secs:
            return EMPTY
        cur = secs[-1]
        begin = (cur.t + 1 if end is None else end) - seconds
        total = [0.0] * SIZE
        if secs[0].t <= begin or len(secs) < (secs.maxlen or 0):  # the seconds reach back far enough
            chosen: list[Bucket] = []
            for b in reversed(secs):  # the newest first: a 10 s window stops after 10 of 120
                if b.t + 1 <= begin:
                    break
                if end is None or b.t < end:
                    chosen.append(b)
            chosen.reverse()  # summed oldest first, as ever: the same float sums
        else:
            k = 1 if self.levels[1] and self.levels[1][0].t <= begin else 2
            width = LEVELS[k][0]
            chosen = [b for b in self.levels[k] if b.t + width > begin] + [cur]
        for b in chosen:  # each sum in the same order as a loop from 0.0, at C speed
            total = list(map(operator.add, total, b.v))
        return times_of(total)

    def series(self, width: int, bucket_s: int) -> list[tuple[int, RankTimes]]:
        """The last `width` buckets of 10 s (`bucket_s` <= 10) or 5 min, oldest first; the last
        one includes the open second."""
        k = 1 if bucket_s <= LEVELS[1][0] else 2
        span = LEVELS[k][0]
        pts: list[tuple[int, Sequence[float]]] = [(b.t, b.v) for b in list(self.levels[k])[-width:]]
        secs = self.levels[0]
        if secs:
            cur = secs[-1]
            start = cur.t - cur.t % span
            if pts and pts[-1][0] == start:
                pts[-1] = (start, [a + b for a, b in zip(pts[-1][1], cur.v)])
            else:
                pts.append((start, cur.v))
        return [(t, times_of(v)) for t, v in pts[-width:]]

    def busy_series(self, width: int, bucket_s: int) -> list[tuple[int, float | None]]:
        """series()'s own time a step (busy_ms; None: no steps), the strip's figure: a closed
        bucket's computed once, not at every refresh of 1,024 ranks' strips."""
        k = 1 if bucket_s <= LEVELS[1][0] else 2
        secs, level = self.levels[0], self.levels[k]
        if not secs:  # nothing rolled either
            return self._final(k, width)
        cur = secs[-1]
        start = cur.t - cur.t % LEVELS[k][0]
        if level and level[-1].t == start:  # the open span: its closed seconds and the open one
            tail = _busy(start, [a + b for a, b in zip(level[-1].v, cur.v)])
        else:
            tail = _busy(start, cur.v)
        return [*self._final(k, width), tail][-width:]

    def busy_spans(self, width: int, bucket_s: int = 10) -> list[tuple[int, float | None]]:
        """busy_series() less its last bucket (the open one): the last `width` closed buckets."""
        k = 1 if bucket_s <= LEVELS[1][0] else 2
        return self._final(k, width)[-width:] if self.levels[0] else self._final(k, width + 1)[:-1]

    def _final(self, k: int, width: int) -> list[tuple[int, float | None]]:
        """The level's last `width` buckets that take no more seconds (all but the open second's
        span), kept: only a bucket that closed since is new."""
        level, secs = self.levels[k], self.levels[0]
        n = len(level)
        if n and secs and level[-1].t == secs[-1].t - secs[-1].t % LEVELS[k][0]:
            n -= 1  # the open second's span: it changes until that second closes and the next begins
        if n == 0:
            return []
        last = level[n - 1]
        got = self._closed.get((k, width))
        if got is None or got[0] is not last:
            kept = dict(zip(map(id, got[1]), got[2])) if got is not None else {}
            buckets = list(itertools.islice(level, max(0, n - width), n))
            pts = [kept.get(id(b)) or _busy(b.t, b.v) for b in buckets]
            got = self._closed[(k, width)] = (last, buckets, pts)
        return got[2]

    def seconds(self, seconds: float, end: float | None = None) -> list[tuple[int, RankTimes]]:
        """Each second's figures over the last `seconds` before `end` (default: the end of the
        latest step's second), oldest first: the job model's second-to-second spread."""
        secs = self.levels[0]
        if not secs:
            return []
        stop = secs[-1].t + 1 if end is None else end
        return [(b.t, times_of(b.v)) for b in secs if stop - seconds <= b.t < stop]


def _busy(t: int, v: Sequence[float]) -> tuple[int, float | None]:
    """A bucket's own time a step, None without steps: a tuple of numbers, no GC container once kept."""
    rt = times_of(v)
    return t, rt.busy_ms if rt.steps else None
