"""Every training step of the run, counted, in bounded memory: what a late joiner is told of the
steps the history no longer holds.

Pure (no sockets, no torch). The agent loop hands `keep` each log chunk it drains; a snapshot
reply carries `tally()`. The probe already counts the step ends of every chunk at C speed
(`LogChunk.steps`); here each chunk adds at most one point, (time of its last step end, steps
ended so far), found by reading back from the chunk's end: no step is replayed on this thread,
which shares the GIL with training. The newest point moves forward until it is `width_ns` past
the one before it; past `limit` points the width doubles and the points closer than that go, so
the run is covered from its first step at about a point a second for ~2 hours, then coarser.
"""

from __future__ import annotations

from typing import Any

from torchtop.contract import logcodes, wire

TALLY_POINTS = 8192
TALLY_WIDTH_NS = 1_000_000_000
SCAN_ITEMS = 64  # read back this many items in Python; past them, the chunk is searched at C speed
START_ITEMS = 4096  # entries searched for the first step's start, per chunk, until it is found


class StepCounter:
    """(step end time, steps ended so far) points from the run's first step on."""

    def __init__(self, limit: int = TALLY_POINTS, width_ns: int = TALLY_WIDTH_NS) -> None:
        self.limit = limit
        self.width = width_ns
        self.start: int | None = None  # the first step's start: its first entry that opens one
        self.ends: list[int] = []
        self.counts: list[int] = []

    def keep(self, chunk: wire.LogChunk) -> None:
        if self.start is None:
            self.start = first_time(chunk)
        if self.counts and chunk.steps <= self.counts[-1]:
            return  # no step ended in it: most chunks of a slow loop
        end = last_step_end(chunk)
        if end is None:
            return  # its step ends were shed (log overflow): they count at the next point
        ends, counts = self.ends, self.counts
        if len(ends) >= 2 and ends[-1] - ends[-2] < self.width:
            ends[-1], counts[-1] = end, chunk.steps
        else:
            ends.append(end)
            counts.append(chunk.steps)
            if len(ends) > self.limit:
                self._coarsen()

    def _coarsen(self) -> None:
        """Double the width; keep the points at least that far apart, and the newest."""
        self.width *= 2
        ends, counts = [self.ends[0]], [self.counts[0]]
        for end, count in zip(self.ends[1:-1], self.counts[1:-1]):
            if end - ends[-1] >= self.width:
                ends.append(end)
                counts.append(count)
        ends.append(self.ends[-1])
        counts.append(self.counts[-1])
        self.ends, self.counts = ends, counts

    def tally(self) -> wire.StepTally | None:
        if self.start is None:
            return None
        return wire.StepTally(self.start, list(self.ends), list(self.counts), self.width)


def _time(item: Any) -> int:
    return item if type(item) is int else item[0]


def first_time(chunk: wire.LogChunk) -> int | None:
    """The time (ns) of a chunk's first entry that opens a step (`logcodes.opens_step`); None when
    its first START_ITEMS entries hold none. Copies logged before the loop (a model moved to the
    GPU, with CUDA's set-up in its first copy) are not the first step's start. Runs until the
    run's first step is found: once a run, on a chunk or two."""
    entries = chunk.entries
    opens = logcodes.opens_step
    if chunk.pairs:
        items = zip(entries[0 : 2 * START_ITEMS : 2], entries[1 : 2 * START_ITEMS : 2])
        for t, code in items:
            try:
                c = logcodes.code_of(code)
                stamp = _time(t)
            except Exception:  # broad: a malformed entry is skipped
                continue
            if stamp > 0 and opens(c):
                return stamp
        return None
    for item in entries[:START_ITEMS]:
        try:
            c = logcodes.code_of(item)
            stamp = _time(item) >> logcodes.SHIFT
        except Exception:  # broad: a malformed entry is skipped
            continue
        if stamp > 0 and opens(c):
            return stamp
    return None


def last_step_end(chunk: wire.LogChunk) -> int | None:
    """The time (ns) of the last training step end in a chunk; None when it holds none."""
    entries = chunk.entries
    ends = logcodes.STEP_ENDS
    try:
        if chunk.pairs:
            pairs = len(entries) // 2
            low = max(0, pairs - SCAN_ITEMS)
            for p in range(pairs - 1, low - 1, -1):
                code = entries[2 * p + 1]
                if (code if isinstance(code, int) else code[0]) in ends:
                    return _time(entries[2 * p])
            codes = entries[1 : 2 * low : 2][::-1]  # pairs low-1 .. 0, at C speed
            found = []
            for c in ends:
                try:
                    found.append(codes.index(c))
                except ValueError:
                    pass
            return _time(entries[2 * (low - 1 - min(found))]) if found else None
        for entry in reversed(entries):  # a CUDA run's entries (already walked once by the resolver)
            if logcodes.code_of(entry) in ends:
                return _time(entry) >> logcodes.SHIFT
    except Exception:  # broad: a malformed chunk: no step end
        return None
    return None
