"""The recording file format: what an agent (or a monitor) keeps of a run on disk.

A segment file is the wire's own frames behind a header, append-only:

    header  = MAGIC (8 bytes) | format version (u16) | protocol version (u16) | reserved (u32)
    frame   = SYNC (4 bytes) | length (u32) | crc32 of the payload (u32) | payload (`length` bytes)
    payload = one wire message, msgpack (wire.encode): a `Hello` or a `Batch`

all little-endian. Every frame is whole in one write(), so a killed writer leaves at most one cut
frame at the end; the sync word and the CRC let a reader find the next good frame after garbage.
A recording is a directory of such segments (recording_store.py says how they rotate and thin).

Imports only msgspec (through wire) and the standard library; importing it starts nothing.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from torchtop.agent.contract import wire
from torchtop.agent.contract.logcodes import last_step, last_step_pairs

FORMAT_VERSION = 1
MAGIC = b"\x89TTREC\r\n"  # PNG-style: a high byte and CR LF show a file mangled by a text transfer
SYNC = b"\xf7TT\x01"
SUFFIX = ".ttrec"
_HEADER = struct.Struct("<8sHHI")
_FRAME = struct.Struct("<4sII")
HEADER_BYTES = _HEADER.size  # 16
FRAME_OVERHEAD = _FRAME.size  # 12
#: A thinned chunk keeps its last whole step; chunks this small are kept whole (slow steps).
THIN_KEEP_ENTRIES = 64
THIN_TELEMETRY_S = 1.0  # the thin track keeps a telemetry sample at most this often


class RecordingError(ValueError):
    """Not a torchtop recording, or one this torchtop cannot read; the message says what to do."""


def header(protocol: int = wire.PROTOCOL_VERSION) -> bytes:
    return _HEADER.pack(MAGIC, FORMAT_VERSION, protocol, 0)


def frame(payload: bytes) -> bytes:
    """One frame around an encoded wire message."""
    return _FRAME.pack(SYNC, len(payload), zlib.crc32(payload)) + payload


def check_header(data: bytes, name: str) -> int:
    """The protocol version the segment was written with; RecordingError when it is not one."""
    if len(data) < HEADER_BYTES:
        raise RecordingError(f"{name}: {len(data)} bytes: too short for a torchtop recording")
    magic, version, protocol, _ = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise RecordingError(f"{name}: not a torchtop recording (no {MAGIC!r} header)")
    if version != FORMAT_VERSION:
        raise RecordingError(
            f"{name}: recording format {version}, this torchtop reads format {FORMAT_VERSION}: "
            "open it with the torchtop version that wrote it"
        )
    if protocol != wire.PROTOCOL_VERSION:
        raise RecordingError(
            f"{name}: recorded with wire protocol {protocol}, this torchtop reads {wire.PROTOCOL_VERSION}: "
            "open it with the torchtop version that wrote it"
        )
    return protocol


@dataclass
class Damage:
    """What a reader skipped in one segment: cut frames at its end, garbage inside."""

    cut_at: int | None = None  # offset of a frame cut short by the end of the file
    skipped: list[tuple[int, int]] = field(
        default_factory=list[tuple[int, int]]
    )  # (offset, bytes) of garbage skipped

    def __bool__(self) -> bool:
        return self.cut_at is not None or bool(self.skipped)

    def line(self, name: str) -> str:
        """One warning line for the segment."""
        parts: list[str] = []
        if self.skipped:
            total = sum(n for _, n in self.skipped)
            parts.append(
                f"{total} damaged bytes skipped in {len(self.skipped)} place(s), first at offset {self.skipped[0][0]}"
            )
        if self.cut_at is not None:
            parts.append(f"cut mid-frame at offset {self.cut_at} (its last frame is lost)")
        return f"{name}: " + "; ".join(parts) + ": read up to and around the damage"


def _valid_at(data: bytes, pos: int) -> int | None:
    """The end of a whole, checked frame at `pos`, or None."""
    if pos + FRAME_OVERHEAD > len(data):
        return None
    sync, length, crc = _FRAME.unpack_from(data, pos)
    end = pos + FRAME_OVERHEAD + length
    if sync != SYNC or length > wire.MAX_FRAME_BYTES or end > len(data):
        return None
    return end if zlib.crc32(data[pos + FRAME_OVERHEAD : end]) == crc else None


def scan(data: bytes, damage: Damage, start: int = HEADER_BYTES) -> Iterator[tuple[int, bytes]]:
    """(offset, payload) of each good frame in a segment's bytes, header excluded. Garbage is
    skipped to the next frame whose sync word, length and CRC check out; a frame cut by the end
    of the data is noted in `damage.cut_at`."""
    pos, n = start, len(data)
    while pos < n:
        end = _valid_at(data, pos)
        if end is not None:
            yield pos, data[pos + FRAME_OVERHEAD : end]
            pos = end
            continue
        nxt = data.find(SYNC, pos + 1)
        while nxt != -1 and _valid_at(data, nxt) is None:
            nxt = data.find(SYNC, nxt + 1)
        if nxt != -1:
            damage.skipped.append((pos, nxt - pos))
            pos = nxt
        elif _cut_short(data, pos):
            damage.cut_at = pos  # the writer was stopped mid-write: the usual end of a killed run
            return
        else:  # nothing good after it: garbage to the end
            damage.skipped.append((pos, n - pos))
            return


def _cut_short(data: bytes, pos: int) -> bool:
    """A frame that starts well at `pos` but runs past the end of the data."""
    if len(data) - pos < FRAME_OVERHEAD:
        return SYNC.startswith(data[pos : pos + 4])
    sync, length, _ = _FRAME.unpack_from(data, pos)
    return sync == SYNC and length <= wire.MAX_FRAME_BYTES and pos + FRAME_OVERHEAD + length > len(data)


def read_segment(path: Path) -> tuple[list[wire.Hello | wire.Batch], Damage]:
    """Every good message of one segment file, in order, and what was skipped. A frame whose
    payload does not decode as a wire message counts as damage. RecordingError: not a
    recording, or another format or protocol version."""
    data = path.read_bytes()
    check_header(data[:HEADER_BYTES], str(path))
    damage = Damage()
    out: list[wire.Hello | wire.Batch] = []
    for offset, payload in scan(data, damage):
        try:
            msg = wire.decode(payload)
        except wire.WireError:
            damage.skipped.append((offset, FRAME_OVERHEAD + len(payload)))
            continue
        if isinstance(msg, (wire.Hello, wire.Batch)):
            out.append(msg)
        else:
            damage.skipped.append((offset, FRAME_OVERHEAD + len(payload)))
    return out, damage


class SegmentWriter:
    """Appends frames to one segment file, each in a single write() on an unbuffered file: a
    frame is in the kernel's hands when `append` returns, so a killed process loses nothing it
    appended."""

    def __init__(self, path: Path, exclusive: bool = False) -> None:
        """`exclusive`: a new file or FileExistsError (two writers never share a segment)."""
        self.path = path
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_EXCL if exclusive else 0)
        self._fd = os.open(path, flags, 0o644)
        self.size = os.fstat(self._fd).st_size
        if self.size == 0:
            self._write(header())

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        self.size += len(data)

    def append(self, payload: bytes) -> None:
        self._write(frame(payload))

    def close(self) -> None:
        if self._fd >= 0:
            try:
                os.fsync(self._fd)
            except OSError:
                pass
            os.close(self._fd)
            self._fd = -1


# -- thinning ------------------------------------------------------------------------------------
def thin_chunk(chunk: wire.LogChunk) -> wire.LogChunk | None:
    """A log chunk reduced to its last whole step (a small chunk is kept whole); None when it
    holds no whole step."""
    n = len(chunk.entries) // 2 if chunk.pairs else len(chunk.entries)
    if n <= THIN_KEEP_ENTRIES:
        return chunk
    tail = last_step_pairs(chunk.entries) if chunk.pairs else last_step(chunk.entries)
    return None if tail is None else wire.LogChunk(chunk.seq, chunk.steps, tail, chunk.pairs)


class Thinner:
    """Batches for the thin track: one step per chunk, telemetry at most once a second."""

    def __init__(self) -> None:
        self._telemetry_at = float("-inf")

    def thin(self, batch: wire.Batch) -> wire.Batch | None:
        log = [c for c in map(thin_chunk, batch.log) if c is not None]
        telemetry = batch.telemetry
        if telemetry is not None:
            if telemetry.time - self._telemetry_at < THIN_TELEMETRY_S:
                telemetry = None
            else:
                self._telemetry_at = telemetry.time
        if not log and telemetry is None and batch.capture is None:
            return None
        return wire.Batch(
            v=batch.v,
            run_id=batch.run_id,
            seq=batch.seq,
            time=batch.time,
            log=log,
            wall_offset=batch.wall_offset,
            rank=batch.rank,
            dropped=batch.dropped,
            hook_errors=batch.hook_errors,
            telemetry=telemetry,
            capture=batch.capture,
        )
