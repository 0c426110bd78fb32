"""The per-second low points of this process's memory, kept for monitors that join later.

A leak shows in memory held between steps, which is the low point of each second (activations
come and go within a step). The agent's fast tick feeds every sample here (10 Hz while watched,
1 Hz otherwise); a monitor's snapshot or `memory` request reads the last ten minutes of lows, so
`torchtop report` judges a leak over the last minute whatever its own window. Pure: no torch.
"""

from __future__ import annotations

from collections import deque

from torchtop.contract.wire import MemoryLow

KEEP_S = 600  # ten minutes of seconds


class MemoryTrend:
    def __init__(self, keep: int = KEEP_S) -> None:
        self._lows: deque[MemoryLow] = deque(maxlen=keep)
        self._second = -1
        self._low: MemoryLow | None = None

    def add(self, now: float, rss: int, allocated: int = 0, steps: int | None = None) -> None:
        """A sample at `now` (unix seconds): RSS and allocated CUDA memory (0: none, or unknown),
        after `steps` training steps (the step count goes with the second's lowest RSS, or
        allocated memory where there is some)."""
        second = int(now)
        low = self._low
        if second != self._second:
            if low is not None:
                self._lows.append(low)
            self._second, self._low = second, MemoryLow(now, rss, allocated, steps)
            return
        assert low is not None
        if 0 < rss < low.rss or low.rss <= 0:
            low.rss = rss
            if not allocated:
                low.steps = steps
        if 0 < allocated < low.allocated or low.allocated <= 0:
            low.allocated = allocated
            if allocated:
                low.steps = steps

    def lows(self) -> list[MemoryLow]:
        """The completed seconds' lows, oldest first."""
        return list(self._lows)
