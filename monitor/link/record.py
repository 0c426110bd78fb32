"""`attach --record PATH`: the monitor keeps what it receives in a recording (the agent's format).

Written on the thread that reads the stream (the TUI's feed worker), one write() a frame, so a
killed monitor loses at most the frame being written. The snapshot a monitor takes on joining is
kept as a batch of its own (its chunks, the reply's sequence number), so a replay of the file
holds what the monitor held. A failing disk is said once; the monitor goes on without recording.
"""

from __future__ import annotations

import time
from pathlib import Path

from torchtop.contract import wire
from torchtop.contract.recording_store import DEFAULT_MAX_BYTES, RecordingWriter


class MonitorRecorder:
    """Opens the recording on the first hello (the rank picks the directory)."""

    def __init__(self, path: Path | str, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.writer: RecordingWriter | None = None
        self.error = ""  # why recording stopped, once it did
        self.note = ""  # where the recording went instead of `path`, and why (it was not private)

    def _write(self, msg: wire.Hello | wire.Batch) -> None:
        if self.error:
            return
        try:
            if self.writer is None:
                self.writer = RecordingWriter(self.path, msg.rank, self.max_bytes)
                self.note = self.writer.note
            self.writer.write(msg)
        except OSError as exc:
            self.error = f"recording to {self.path} stopped: {exc.strerror or exc}"

    def hello(self, hello: wire.Hello) -> None:
        self._write(hello)

    def snapshot(self, reply: wire.Reply) -> None:
        if reply.ok and reply.log:
            self._write(
                wire.Batch(
                    v=wire.PROTOCOL_VERSION,
                    run_id=reply.run_id,
                    seq=reply.seq,
                    time=time.time(),
                    log=reply.log,
                    wall_offset=reply.wall_offset,
                    rank=reply.rank,
                )
            )

    def batch(self, batch: wire.Batch) -> None:
        self._write(batch)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
