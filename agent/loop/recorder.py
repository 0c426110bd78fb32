"""The agent's recorder thread: writes what the agent loop hands it to a recording on disk.

The agent loop puts each tick's batch (and the Hello when it changes) on a bounded queue and
never waits: a full queue (a stalled disk) drops the batch, counted, and the recording shows a
gap there. This thread encodes what the loop did not already encode, thins it for the thin track
and appends both (contract/recording_store.py): one write() a frame, so a killed run loses only
what was not yet drained from the training thread's log (at most a tick, 0.5 s). A failing disk
is said once on stderr; the recording stops, training goes on.

Where no launcher named the rank (mp.spawn sets no RANK), the rank directory waits for `settle`
(the agent, once the process group names the rank or the process trains on its own): until
then batches are held, bounded (the oldest dropped, counted), and written first, as that rank's.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from torchtop.agent.warn import warn
from torchtop.contract import wire
from torchtop.contract.recording_store import DEFAULT_MAX_BYTES, RecordingWriter, rank_dir

if TYPE_CHECKING:
    from torchtop.contract.recording_store import RecordingWriter as Writer

QUEUE_ITEMS = 64  # ~6 s of ticks while a monitor listens, 30 s otherwise
HELD_ITEMS = 256  # batches held while the rank is unknown: ~4 min unattended, before the oldest go
_STOP = None


@dataclass(frozen=True)
class _Settle:
    """The rank is known: open its directory, write `hello` and the held batches first."""

    rank: int
    hello: wire.Hello


_Item = tuple[wire.Hello | wire.Batch, bytes | None]


class Recorder(threading.Thread):
    """Owns the RecordingWriter; `put` is what the agent loop calls."""

    def __init__(self, path: Path, rank: int | None = 0, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        """`rank` None: not known yet; batches are held until `settle` names it."""
        super().__init__(name="torchtop-recorder", daemon=True)
        self.path = path
        self.max_bytes = max_bytes
        self.rank = rank  # the agent thread's view: None until settled
        self.writer: Writer | None = None
        self.directory: Path | None = None  # the rank's directory, once known
        if rank is not None:
            self._open(rank)  # OSError: the caller says so
        self.queue: queue.Queue[_Item | _Settle | None] = queue.Queue(QUEUE_ITEMS)
        self.held: deque[_Item] = deque(maxlen=HELD_ITEMS)  # recorder thread only
        self.held_dropped = 0  # batches held too long: the oldest went
        self._settle: _Settle | None = None  # a settle the full queue turned away: sent first next
        self.dropped = 0  # batches the full queue turned away
        self.failed = ""  # why recording stopped, if it did
        self.busy_ns = 0  # this thread's CPU time at work
        self._closed = False

    def _open(self, rank: int) -> None:
        self.writer = RecordingWriter(self.path, rank, self.max_bytes)
        self.directory = self.writer.directory
        if self.writer.note:  # not where asked: say where it went, and why
            warn(self.writer.note)

    def settle(self, rank: int, hello: wire.Hello) -> None:
        """Agent thread, once: the rank is known (`hello` says it). Never blocks."""
        if self.rank is not None or self._closed:
            return
        self.rank = rank
        self.directory = rank_dir(self.path, rank)  # for the start line; the writer's own once open
        self._settle = _Settle(rank, hello)
        self._send_settle()

    def _send_settle(self, timeout: float | None = None) -> bool:
        """The settle ahead of anything put after it; False while the queue stays full."""
        item = self._settle
        if item is not None:
            try:
                if timeout:
                    self.queue.put(item, timeout=timeout)
                else:
                    self.queue.put_nowait(item)
            except queue.Full:
                return False
            self._settle = None
        return True

    def put(self, msg: wire.Hello | wire.Batch, payload: bytes | None = None) -> None:
        """Agent thread: hand over a message (and its encoding, when it was sent too). Never blocks."""
        if self.failed or self._closed:
            return
        if self.rank is None and isinstance(msg, wire.Hello):
            return  # the settled rank's Hello is written instead
        if not self._send_settle():
            self.dropped += 1
            return
        try:
            self.queue.put_nowait((msg, payload))
        except queue.Full:
            self.dropped += 1

    def run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:  # _STOP
                break
            if self.failed:
                continue
            busy = time.thread_time_ns()
            try:
                if isinstance(item, _Settle):
                    self._settled(item)
                elif self.writer is None:  # the rank is not known yet
                    if len(self.held) == self.held.maxlen:
                        self.held_dropped += 1
                    self.held.append(item)
                else:
                    self.writer.write(*item)
            except Exception as exc:  # broad: a failing disk stops the recording, never training
                self.failed = f"{type(exc).__name__}: {exc}"
                where = self.directory or self.path
                warn(f"recording to {where} stopped ({self.failed}); training goes on")
            self.busy_ns += time.thread_time_ns() - busy
        self.held.clear()  # never settled: a launcher or helper that did not train records nothing
        if self.writer is not None:
            try:
                self.writer.close()
            except OSError:
                pass

    def _settled(self, item: _Settle) -> None:
        """Recorder thread: open the rank's directory; its Hello, then the held batches as its."""
        try:
            self._open(item.rank)
        except OSError as exc:
            self.failed = f"cannot record to {self.path} ({exc.strerror or exc})"
            warn(f"{self.failed}; training goes on without a recording")
            return
        writer = self.writer
        assert writer is not None
        writer.write(item.hello)
        while self.held:
            msg, payload = self.held.popleft()
            if isinstance(msg, wire.Batch) and msg.rank != item.rank:  # built before the rank was known
                msg, payload = msgspec.structs.replace(msg, rank=item.rank), None
            writer.write(msg, payload)

    def close(self, timeout: float = 5.0) -> None:
        """After the agent loop's last tick: write what is queued, then close the files."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._send_settle(timeout):
                self.queue.put(_STOP, timeout=timeout)
        except queue.Full:
            pass
        if self.is_alive():
            self.join(timeout)
        if self.dropped:
            where = self.directory or self.path
            warn(f"recording to {where}: {self.dropped} batches dropped (the disk fell behind)")
        if self.held_dropped and self.directory is not None:
            warn(
                f"recording to {self.directory}: its first {self.held_dropped} batches dropped "
                "(held until the process group named this rank, too long)"
            )
