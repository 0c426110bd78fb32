"""The agent's recorder thread: writes what the agent loop hands it to a recording on disk.

The agent loop puts each tick's batch (and the Hello when it changes) on a bounded queue and
never waits: a full queue (a stalled disk) drops the batch, counted, and the recording shows a
gap there. This thread encodes what the loop did not already encode, thins it for the thin track
and appends both (contract/recording_store.py): one write() a frame, so a killed run loses only
what was not yet drained from the training thread's log (at most a tick, 0.5 s). A failing disk
is said once on stderr; the recording stops, training goes on.
"""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from torchtop.agent.warn import warn
from torchtop.contract.recording_store import DEFAULT_MAX_BYTES, RecordingWriter

if TYPE_CHECKING:
    from torchtop.contract import wire

QUEUE_ITEMS = 64  # ~6 s of ticks while a monitor listens, 30 s otherwise
_STOP = None


class Recorder(threading.Thread):
    """Owns the RecordingWriter; `put` is what the agent loop calls."""

    def __init__(self, path: Path, rank: int = 0, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        super().__init__(name="torchtop-recorder", daemon=True)
        self.writer = RecordingWriter(path, rank, max_bytes)  # OSError: the caller says so
        self.directory = self.writer.directory
        if self.writer.note:  # not where asked: say where it went, and why
            warn(self.writer.note)
        self.queue: queue.Queue[tuple[wire.Hello | wire.Batch, bytes | None] | None] = queue.Queue(
            QUEUE_ITEMS
        )
        self.dropped = 0  # batches the full queue turned away
        self.failed = ""  # why recording stopped, if it did
        self.busy_ns = 0  # this thread's CPU time at work
        self._closed = False

    def put(self, msg: wire.Hello | wire.Batch, payload: bytes | None = None) -> None:
        """Agent thread: hand over a message (and its encoding, when it was sent too). Never blocks."""
        if self.failed or self._closed:
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
                self.writer.write(*item)
            except Exception as exc:  # broad: a failing disk stops the recording, never training
                self.failed = f"{type(exc).__name__}: {exc}"
                warn(f"recording to {self.directory} stopped ({self.failed}); training goes on")
            self.busy_ns += time.thread_time_ns() - busy
        try:
            self.writer.close()
        except OSError:
            pass

    def close(self, timeout: float = 5.0) -> None:
        """After the agent loop's last tick: write what is queued, then close the files."""
        if self._closed:
            return
        self._closed = True
        try:
            self.queue.put(_STOP, timeout=timeout)
        except queue.Full:
            pass
        if self.is_alive():
            self.join(timeout)
        if self.dropped:
            warn(f"recording to {self.directory}: {self.dropped} batches dropped (the disk fell behind)")
