"""CUDA device time of the phases, from pooled events resolved off the training thread.

The training thread records events from a pool on sampled steps only; the agent thread polls
`Event.query()` (never `synchronize`) and calls `elapsed_time` once both events of a pair have
completed, then returns the events to the pool. The sampling stride keeps event recording under
a budget of the step time, measured as it runs.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Any

from .wire import TIMED_PHASES

BUDGET = 0.003  # event recording may take at most this share of step wall time
MAX_PENDING = 4096  # sampled steps waiting for the GPU; beyond this, their device times are dropped
GIVE_UP_S = 30.0  # events not completed after this are abandoned (a hung kernel, a dead context)


class EventPool:
    """Reusable timing events. `take` runs on the training thread; everything else on the agent's."""

    def __init__(self, torch: Any, size: int = 512) -> None:
        self._torch = torch
        self._free: deque[Any] = deque()
        self.target = size
        self.misses = 0
        self.top_up()

    def top_up(self) -> None:
        # Event objects are created here; the CUDA event itself lazily at its first record().
        while len(self._free) < self.target:
            self._free.append(self._torch.cuda.Event(enable_timing=True))

    def current_stream(self) -> Any:
        return self._torch.cuda.current_stream()

    def take(self) -> Any:
        try:
            return self._free.pop()
        except IndexError:
            self.misses += 1
            return None

    def give(self, ev: Any) -> None:
        if ev is not None:
            self._free.append(ev)


class DeviceTimer:
    """Keeps raw steps in order until their events (if any) completed, then yields device ms.

    Steps without events pass straight through, but never overtake an earlier sampled step.
    """

    def __init__(self, pool: EventPool | None) -> None:
        self.pool = pool
        self._pending: deque[tuple[float, Any]] = deque()
        self.abandoned = 0
        self._record_cost: deque[tuple[int, int]] = deque(maxlen=64)  # (record_ns, wall_ns)

    def submit(self, raw: Any) -> None:
        self._pending.append((time.monotonic(), raw))

    def run(self, raws: list[Any]) -> list[tuple[Any, dict[str, float] | None]]:
        """Submit `raws`, then return every step now ready, in order. Steps without events or
        CUDA marks, with nothing pending ahead of them (every step on a CPU run), pass straight."""
        if not self._pending and all(raw[6] is None and _marks_done(raw) for raw in raws):
            return [(raw, None) for raw in raws]
        for raw in raws:
            self.submit(raw)
        return self.poll()

    def poll(self) -> list[tuple[Any, dict[str, float] | None]]:
        """Raw steps whose events completed (or were abandoned), in order, with device times."""
        out = []
        now = time.monotonic()
        while self._pending:
            since, raw = self._pending[0]
            events = raw[6]
            pairs = events[:-1] if events is not None else ()
            if all(_done(s) and _done(e) for _, s, e in pairs) and _marks_done(raw):
                _read_marks(raw)
                out.append(self._finish(raw, self._elapsed(pairs)) if events is not None else (raw, None))
            elif now - since > GIVE_UP_S or len(self._pending) > MAX_PENDING:
                self.abandoned += 1
                out.append((raw, None))  # events stay out of the pool: they may never complete
            else:
                break
            self._pending.popleft()
        return out

    def _elapsed(self, pairs: list) -> dict[str, float]:
        ms: dict[str, float] = {}
        for phase, s, e in pairs:
            if s is None or e is None:
                continue
            name = "step" if phase < 0 else TIMED_PHASES[phase]
            ms[name] = ms.get(name, 0.0) + s.elapsed_time(e)
        return ms

    def _finish(self, raw: Any, ms: dict[str, float] | None) -> tuple[Any, dict[str, float] | None]:
        events = raw[6]
        self._record_cost.append((events[-1], raw[3]))
        if self.pool is not None:
            for _, s, e in events[:-1]:
                self.pool.give(s)
                self.pool.give(e)
        return raw, ms

    def pending(self) -> int:
        return len(self._pending)

    def stride(self, current: int) -> int:
        """Sample one step in k so that event recording stays under BUDGET of step time."""
        if not self._record_cost:
            return current
        rec = sorted(r for r, _ in self._record_cost)[len(self._record_cost) // 2]
        wall = sorted(w for _, w in self._record_cost)[len(self._record_cost) // 2]
        if wall <= 0:
            return current
        return max(1, min(1000, math.ceil(rec / (BUDGET * wall))))


def _done(ev: Any) -> bool:
    return ev is None or ev.query()


def _read_marks(raw: Any) -> None:
    """CUDA marks whose copy landed become floats: the pinned copies are not kept in history."""
    extra = raw[7] if len(raw) > 7 else None
    if extra and "marks" in extra:
        extra["marks"] = [(name, float(v[0]) if isinstance(v, tuple) else v) for name, v in extra["marks"]]


def _marks_done(raw: Any) -> bool:
    """User marks of CUDA tensors travel as (pinned copy, event): ready once the copy landed."""
    extra = raw[7] if len(raw) > 7 else None
    if not extra or "marks" not in extra:
        return True
    return all(not isinstance(v, tuple) or _done(v[1]) for _, v in extra["marks"])
