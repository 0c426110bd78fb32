"""A bound on the steps a monitor replays per second (the exporter's, whatever the step rate).

Whole log chunks are kept while the budget allows and dropped otherwise; the replay sees a gap
there and forgets the open step (log_replay.py), so what it replays is a sample of whole steps.
The agent's own step count rides on every chunk (`LogChunk.steps`), so counts and rates stay
exact: `steps` and `rate()` read those, not the replayed steps. Pure.
"""

from __future__ import annotations

from collections import deque

from torchtop.contract.wire import LogChunk

RATE_WINDOW_S = 10.0


class StepBudget:
    """A token bucket of steps: `rate` a second on average, up to `rate` saved up."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.tokens = rate
        self.at: float | None = None
        self.steps = 0  # the agent's step count, from the newest chunk seen
        self.kept = 0
        self.skipped = 0
        self._counts: deque[tuple[float, int]] = deque()

    def filter(self, chunks: list[LogChunk], now: float) -> list[LogChunk]:
        if self.at is not None:
            self.tokens = min(self.rate, self.tokens + (now - self.at) * self.rate)
        self.at = now
        out: list[LogChunk] = []
        for c in chunks:
            n = max(0, c.steps - self.steps) if self.steps else c.steps
            if c.steps >= self.steps:
                self.steps = c.steps
            if n <= self.tokens or self.tokens >= self.rate:  # a chunk bigger than a second's budget:
                self.tokens -= n  # kept when the bucket is full, which then refills from below 0
                self.kept += n
                out.append(c)
            else:
                self.skipped += n
        if chunks:
            self._counts.append((now, self.steps))
            while self._counts and now - self._counts[0][0] > RATE_WINDOW_S:
                self._counts.popleft()
        return out

    def rate_now(self) -> float | None:
        """Steps per second over the last RATE_WINDOW_S, from the agent's own counts; None until
        two counts a moment apart have been seen (a first chunk says nothing about a rate)."""
        if len(self._counts) < 2:
            return None
        (t0, s0), (t1, s1) = self._counts[0], self._counts[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else None
