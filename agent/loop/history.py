"""The late-join history: the log chunks the agent keeps for monitors that attach mid-run.

Pure (no sockets, no torch): the agent loop `keep`s every chunk it drains; a snapshot request
reads `snapshot(limit)`, a first subscriber's catch-up `recent(...)`. Every entry of the newest
chunks is kept up to a bound; older chunks are thinned to their last whole step.
"""

from __future__ import annotations

from collections import deque

from torchtop.contract import wire
from torchtop.contract.logcodes import last_step, last_step_pairs

HISTORY_ENTRIES = 150_000  # every entry of the last ~15k steps (~10 a step), for late joiners
SPARSE_CHUNKS = 6_000  # before those: one step per chunk (~one per tick): 10 minutes at any rate


class LogHistory:
    """Every entry of the last `entries` log entries; older chunks thinned to a step each."""

    def __init__(self, entries: int | None = None, sparse_chunks: int | None = None) -> None:
        self.limit = HISTORY_ENTRIES if entries is None else entries
        self.full: deque[wire.LogChunk] = deque()  # every entry, up to `limit`
        self._entries = 0
        # older: a step per chunk
        self.sparse: deque[wire.LogChunk] = deque(
            maxlen=SPARSE_CHUNKS if sparse_chunks is None else sparse_chunks
        )

    def keep(self, chunk: wire.LogChunk) -> None:
        full = self.full
        full.append(chunk)
        self._entries += size(chunk)
        while self._entries > self.limit and len(full) > 1:
            old = full.popleft()
            self._entries -= size(old)
            tail = last_step_pairs(old.entries) if old.pairs else last_step(old.entries)
            if tail is not None:
                self.sparse.append(wire.LogChunk(old.seq, old.steps, tail, old.pairs))

    def recent(self, chunks: int, entries: int) -> list[wire.LogChunk]:
        """The newest chunks: at most `chunks` of them and about `entries` entries, oldest first."""
        out: list[wire.LogChunk] = []
        for chunk in reversed(self.full):
            entries -= size(chunk)
            if len(out) == chunks or (out and entries < 0):
                break
            out.append(chunk)
        return out[::-1]

    def snapshot(self, limit: int) -> list[wire.LogChunk]:
        """Chunks holding at least `limit` steps (or all there are), oldest first: the newest
        full chunks, then thinned ones (a step each) before them."""
        full = list(self.full)
        if not full:
            return list(self.sparse)[-limit:]
        newest = full[-1].steps
        k = len(full)
        while k > 0 and newest - full[k - 1].steps < limit:
            k -= 1
        if k > 0:  # one chunk more: it holds the boundary the first step starts at
            return full[k - 1 :]
        more = limit - (newest - full[0].steps)
        return (list(self.sparse)[-more:] if more > 0 else []) + full


def size(chunk: wire.LogChunk) -> int:
    """Entries in a chunk (a pair is one)."""
    return len(chunk.entries) // 2 if chunk.pairs else len(chunk.entries)
