"""CUDA device time of the phases, from pooled events resolved off the training thread.

The training thread records events from a pool on event steps only; the agent thread polls
`Event.query()` (never `synchronize`) and calls `elapsed_time` once both events of a pair have
completed, writes the device times into the log in place of the events (the monitor replays
it), then returns the events to the pool. The sampling stride keeps event recording under
a budget of the step time, measured as it runs.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from torchtop.contract.logcodes import (
    BOUNDARY,
    COMM_GROUP,
    H2D_COPY,
    MARK,
    MASK,
    SHIFT,
    STEP_END,
    STEP_EVENT,
)

if TYPE_CHECKING:
    from types import ModuleType

    from torch.cuda import Event, Stream

# The share of step wall time that event steps may cost. An event step costs more than its
# record() calls (housekeeping, the stream lookup, cold caches): the stride counts its whole
# measured cost. Strides as measured: docs/benchmarks.md.
BUDGET = 0.0003
MAX_PENDING = 4096  # event steps waiting for the GPU; beyond this, their device times are dropped
GIVE_UP_S = 30.0  # events not completed after this are abandoned (a hung kernel, a dead context)


class EventPool:
    """Reusable timing events. `recorded` runs on the training thread; everything else on the agent's."""

    def __init__(self, torch: ModuleType, size: int = 512) -> None:
        self._torch = torch
        self._free: deque[Event] = deque()
        self.target = size
        self.misses = 0
        # the C method under torch.cuda.Event.record: a Python frame less on the training thread
        base = getattr(torch._C, "_CudaEventBase", None)
        event_cls = torch.cuda.Event
        self._record = base.record if base is not None and issubclass(event_cls, base) else event_cls.record
        self.top_up()

    def top_up(self) -> None:
        # Event objects are created here; the CUDA event itself lazily at its first record().
        while len(self._free) < self.target:
            self._free.append(self._torch.cuda.Event(enable_timing=True))

    def current_stream(self) -> Stream:
        return self._torch.cuda.current_stream()

    def recorded(self, stream: Stream | None) -> Event | None:
        """Training thread: a pooled event, recorded now on `stream` (None if the pool ran dry)."""
        try:
            ev = self._free.pop()
        except IndexError:
            self.misses += 1
            return None
        self._record(ev, stream)
        return ev

    def give(self, ev: Event | None) -> None:
        if ev is not None:
            self._free.append(ev)


class EventResolver:
    """Replaces the CUDA events in drained log entries with device times, chunk by chunk, in
    order: a chunk leaves once every event in it has completed (or after GIVE_UP_S).

    A phase entry's event becomes its time in ms from the event step's STEP_EVENT (the monitor
    subtracts pairs); an h2d copy's pair becomes its duration; a CUDA mark becomes its value.
    Events go back to the pool once read. Chunks without tuples (every chunk of a CPU run, the
    the other steps of a CUDA one) cost one scan.
    """

    def __init__(self, pool: EventPool | None) -> None:
        self.pool = pool
        self._pending: deque[tuple[float, list[Any], int, list[int]]] = deque()
        self._ref: Event | None = None  # the STEP_EVENT event of the event step being read
        self._ref_ns = 0
        self.abandoned = 0
        self.event_steps = 0  # event steps whose device times were read
        self._record_cost: deque[tuple[int, int]] = deque(maxlen=64)  # (record_ns, wall_ns)
        self._costed = 0  # event steps read when the stride was last worked out

    def run(self, entries: list[Any], steps: int) -> list[tuple[list[Any], int]]:
        """Submit one drained chunk; return every chunk now ready, in order."""
        tuples = [k for k, e in enumerate(entries) if type(e) is tuple]
        if not tuples and not self._pending:
            return [(entries, steps)]
        self._pending.append((time.monotonic(), entries, steps, tuples))
        return self.poll()

    def poll(self) -> list[tuple[list[Any], int]]:
        out = []
        now = time.monotonic()
        while self._pending:
            since, entries, steps, tuples = self._pending[0]
            done = all(_done(entries[k]) for k in tuples)
            if not done and now - since <= GIVE_UP_S and len(self._pending) <= MAX_PENDING:
                break
            if not done:
                self.abandoned += 1  # its events stay out of the pool: they may never complete
            self._convert(entries, tuples, done)
            out.append((entries, steps))
            self._pending.popleft()
        return out

    def pending(self) -> int:
        return len(self._pending)

    # -- one chunk -----------------------------------------------------------------------------
    def _give(self, ev: Event | None, done: bool) -> None:
        if done and ev is not None and self.pool is not None and ev is not self._ref:
            self.pool.give(ev)

    def _since_ref(self, ev: Event | None, done: bool) -> float | None:
        return _elapsed(self._ref, ev) if done else None

    def _drop_ref(self, done: bool) -> None:
        ref, self._ref = self._ref, None
        self._give(ref, done)

    def _convert(self, entries: list[Any], tuples: list[int], done: bool) -> None:
        for k in tuples:
            e = entries[k]
            head = e[0]
            code = head & MASK
            if code == STEP_EVENT:
                self._drop_ref(done)
                self._ref, self._ref_ns = e[1], head >> SHIFT
                entries[k] = (head, 0.0 if e[1] is not None and done else None)
            elif code == BOUNDARY or code == STEP_END:
                ms = self._since_ref(e[1], done)
                if ms is not None:
                    self.event_steps += 1
                    self._record_cost.append((e[2], (head >> SHIFT) - self._ref_ns))
                entries[k] = (head, ms, e[2])
                self._give(e[1], done)
                self._drop_ref(done)
            elif code == H2D_COPY:
                _, dt, nbytes, pinned, ev0, ev1 = e
                entries[k] = (head, dt, nbytes, pinned, _elapsed(ev0, ev1) if done else None)
                self._give(ev0, done)
                self._give(ev1, done)
            elif code == MARK:
                value = e[2]
                if type(value) is tuple:  # (pinned copy, event) of a CUDA tensor
                    try:
                        value = float(value[0]) if done else None
                    except Exception:  # broad: a mark's value that cannot be read is unknown
                        value = None
                    entries[k] = (head, e[1], value)
            elif code == COMM_GROUP:  # a name, no event
                continue
            elif len(e) == 2:  # a phase entry of an event step
                entries[k] = (head, self._since_ref(e[1], done))
                self._give(e[1], done)

    # -- sampling stride -----------------------------------------------------------------------
    def stride(self, current: int) -> int:
        """Sample one step in k so that event recording stays under BUDGET of step time."""
        if not self._record_cost or self._costed == self.event_steps:
            return current  # nothing new: no sorting on this tick
        self._costed = self.event_steps
        rec = sorted(r for r, _ in self._record_cost)[len(self._record_cost) // 2]
        wall = sorted(w for _, w in self._record_cost)[len(self._record_cost) // 2]
        if wall <= 0:
            return current
        return max(1, min(1000, math.ceil(rec / (BUDGET * wall))))


def _elapsed(start: Event | None, end: Event | None) -> float | None:
    """ms between two completed events; None when either is missing or cannot be read (never
    recorded, another device): no device time, nothing else lost."""
    if start is None or end is None:
        return None
    try:
        return start.elapsed_time(end)
    except Exception:  # broad: an event not recorded, or on another device: unknown
        return None


def _done(entry: tuple) -> bool:
    """Every CUDA event in a log tuple has completed (query(): never synchronizes)."""
    code = entry[0] & MASK
    if code == MARK:
        value = entry[2]
        return type(value) is not tuple or value[1].query()
    if code == H2D_COPY:
        return all(ev is None or ev.query() for ev in entry[4:6])
    if code == COMM_GROUP:
        return True
    if code in (STEP_EVENT, BOUNDARY, STEP_END) or len(entry) == 2:
        ev = entry[1]
        return ev is None or not hasattr(ev, "query") or ev.query()
    return True
