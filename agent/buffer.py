"""A bounded hand-off buffer from the training thread to the agent thread.

The training thread only appends; when the agent falls behind, the oldest entry is dropped and
counted, so the training thread never waits and memory stays bounded.
"""

from __future__ import annotations

from collections import deque
from typing import Any


class DropOldestBuffer:
    """deque-backed ring: `append` never blocks; `drain` takes everything queued so far.

    deque.append/popleft are atomic under the GIL, so no lock is taken on the hot path. The
    drop count can be off by one under a race; it is a statistic, not an invariant.
    """

    __slots__ = ("_items", "capacity", "dropped")

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._items: deque[Any] = deque(maxlen=capacity)
        self.dropped = 0

    def append(self, item: Any) -> None:
        if len(self._items) >= self.capacity:
            self.dropped += 1
        self._items.append(item)

    def drain(self) -> list[Any]:
        out = []
        pop = self._items.popleft
        try:
            while True:
                out.append(pop())
        except IndexError:
            return out

    def __len__(self) -> int:
        return len(self._items)
