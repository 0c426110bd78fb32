# pyright: basic
# basic, not strict: feeds the recorder's raw step tuples (replay.py)
"""Log chunks to steps: each chunk of an agent's log replayed once and in order (replay.py).

Chunks arrive from snapshots and from the stream, overlapping and sometimes with gaps; here
they are deduplicated by sequence number, a gap forgets the open step, and step numbers carry
on from the agent's own count.
"""

from __future__ import annotations

from typing import Any

from torchtop.contract.logcodes import RESET, STEP_ENDS, code_of, to_entries
from torchtop.contract.wire import LogChunk
from torchtop.monitor.model.replay import StepRecorder
from torchtop.monitor.model.step_pack import to_record
from torchtop.monitor.model.steps import StepRecord


class LogReplay:
    """One agent's log chunks → StepRecords, each chunk once and in order.

    Chunks come from snapshots and from the stream, overlapping: one already replayed is
    skipped; a gap (chunks never received) forgets the open step. Step numbers continue from
    the agent's count of training steps where the replay starts or resumes.
    """

    def __init__(self, run_id: str = "") -> None:
        self.run_id = run_id
        self.rec = StepRecorder()
        self.next_seq: int | None = None
        self._held: tuple | None = None  # a step that ended just before its chunk did

    @property
    def failures(self) -> int:
        return self.rec.failures

    def feed(
        self, chunks: list[LogChunk], wall_offset: float, rank: int, flush: bool = False
    ) -> list[StepRecord]:
        """The steps these chunks complete. A step that ended at the very end of the chunks is
        held until the next call (a batch or a heartbeat, ~0.1 s later) unless `flush`: a mark
        logged right after `optimizer.step()` belongs to it and may come in the next chunk, the
        agent having drained in between."""
        held, self._held = self._held, None
        out: list[tuple] = []
        rec = self.rec
        for chunk in chunks:
            if self.next_seq is not None and chunk.seq < self.next_seq:
                continue  # replayed already (a catch-up batch, a snapshot's overlap)
            if self.next_seq is None:
                rec.partial = chunk.seq != 0  # joined late: the first step's start is not here
            elif chunk.seq != self.next_seq:
                rec.reset()
            entries = chunk.entries
            ends: int | None = None
            if chunk.pairs:  # as the training thread wrote them: converted here, not in training
                try:
                    entries, ends = to_entries(entries)
                except Exception:  # broad: hostile or corrupt input: counted, the replay reset
                    rec.failures += 1
                    rec.reset()
                    self.next_seq = chunk.seq + 1
                    continue
            rec.index = max(rec.index, chunk.steps - _closing_boundaries(entries, ends))
            out.extend(rec.feed(entries))
            self.next_seq = chunk.seq + 1
        if out and rec.fresh and not flush:
            self._held = out.pop()  # released by the next call, whatever it brings (a heartbeat)
        if held is not None:
            out.insert(0, held)
        return [to_record(raw, wall_offset, rank) for raw in out]


def _closing_boundaries(entries: list[Any], ends: int | None = None) -> int:
    """Training step ends in `entries` that close a step (a chunk of the agent's sparse history
    opens with RESET and a boundary that only opens one); `ends`: their count, when known."""
    n = 0
    if ends is not None:
        n = ends
    else:
        for e in entries:
            try:
                n += code_of(e) in STEP_ENDS
            except Exception:  # broad: a malformed entry is skipped
                pass
    if len(entries) > 1 and entries[0] == RESET and n:
        try:
            n -= code_of(entries[1]) in STEP_ENDS
        except Exception:  # broad: a malformed entry is skipped
            pass
    return n
