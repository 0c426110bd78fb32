"""The recording file format: what an agent (or a monitor) keeps of a run on disk.

A segment file is the wire's own frames behind a header, append-only:

    header  = MAGIC (8 bytes) | format version (u16) | protocol version (u16) | writer (u32)
    frame   = SYNC (4 bytes) | length (u32) | crc32 of the payload (u32) | payload (`length` bytes)
    payload = one wire message, msgpack (wire.encode): a `Hello` or a `Batch`; empty: the end

all little-endian. `writer` is the torchtop version that wrote it (major << 16 | minor << 8 |
patch; 0 in format 1), so an older torchtop can say which version to install. Every frame is
whole in one write(), so a killed writer leaves at most one cut frame at the end; the sync word
and the CRC let a reader find the next good frame after garbage. A writer that closes a segment
appends the end marker (format 2): a segment without one was cut (the run was killed).
A recording is a directory of such segments (recording_store.py says how they rotate and thin).

Compatibility (docs/recording.md): this torchtop reads formats READ_FORMATS of the wire
protocols READ_PROTOCOLS (this one and the one before, upgraded by recording_compat.py); a
newer file is refused with the version to install.

Imports only msgspec (through wire) and the standard library; importing it starts nothing.
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from torchtop.contract import wire
from torchtop.contract.logcodes import last_step, last_step_pairs
from torchtop.contract.private import create_file

FORMAT_VERSION = 2
READ_FORMATS = (1, 2)  # 1: no end marker, no writer version
READ_PROTOCOLS = (wire.PROTOCOL_VERSION - 1, wire.PROTOCOL_VERSION)
MAGIC = b"\x89TTREC\r\n"  # PNG-style: a high byte and CR LF show a file mangled by a text transfer
SYNC = b"\xf7TT\x01"
SUFFIX = ".ttrec"
END = b""  # the end marker's payload
_HEADER = struct.Struct("<8sHHI")
_FRAME = struct.Struct("<4sII")
HEADER_BYTES = _HEADER.size  # 16
FRAME_OVERHEAD = _FRAME.size  # 12
#: A resync checks at most this many bytes of CRC per byte of the file on candidates that fail
#: (a file of sync words every 12 bytes): linear time, whatever the damage.
RESYNC_WORK = 4
#: A thinned chunk keeps its last whole step; chunks this small are kept whole (slow steps).
THIN_KEEP_ENTRIES = 64
THIN_TELEMETRY_S = 1.0  # the thin track keeps a telemetry sample at most this often


class RecordingError(ValueError):
    """Not a torchtop recording, or one this torchtop cannot read; the message says what to do."""


def _this_version() -> str:
    try:
        from importlib.metadata import version

        return version("torchtop")
    except Exception:  # broad: no package metadata (a source tree): version unknown
        return ""


def pack_version(text: str) -> int:
    """ "0.3.1" -> 0x000301; 0 when it is not three small numbers."""
    try:
        major, minor, patch = (int(x) for x in text.split("+")[0].split(".")[:3])
    except ValueError:
        return 0
    return major << 16 | minor << 8 | patch if max(major, minor, patch) < 256 and major < 65536 else 0


def unpack_version(n: int) -> str:
    return f"{n >> 16}.{n >> 8 & 255}.{n & 255}" if n else ""


def header(
    protocol: int = wire.PROTOCOL_VERSION, version: int = FORMAT_VERSION, writer: str | None = None
) -> bytes:
    return _HEADER.pack(MAGIC, version, protocol, pack_version(_this_version() if writer is None else writer))


def frame(payload: bytes) -> bytes:
    """One frame around an encoded wire message (END: the end marker)."""
    return _FRAME.pack(SYNC, len(payload), zlib.crc32(payload)) + payload


@dataclass(frozen=True)
class Header:
    format: int
    protocol: int
    writer: str  # the torchtop version that wrote it; "" unknown (format 1)


def check_header(data: bytes, name: str) -> Header:
    """What the segment's header says; RecordingError when it is not one this torchtop reads."""
    if len(data) < HEADER_BYTES:
        raise RecordingError(f"{name}: {len(data)} bytes: too short for a torchtop recording")
    magic, version, protocol, writer_n = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise RecordingError(f"{name}: not a torchtop recording (no {MAGIC!r} header)")
    writer = unpack_version(writer_n) if version >= 2 else ""
    by = f" by torchtop {writer}" if writer else ""
    install = f"install torchtop>={writer}" if writer else "install a newer torchtop"
    if version > FORMAT_VERSION or (version in READ_FORMATS and protocol > wire.PROTOCOL_VERSION):
        what = f"format {version}" if version > FORMAT_VERSION else f"wire protocol {protocol}"
        raise RecordingError(
            f"{name}: recording {what} (written{by}); this torchtop ({_this_version() or '?'}) reads "
            f"formats {_span(READ_FORMATS)} of wire protocols {_span(READ_PROTOCOLS)}: {install} to read it"
        )
    if version not in READ_FORMATS or protocol not in READ_PROTOCOLS:
        what = f"format {version}" if version not in READ_FORMATS else f"wire protocol {protocol}"
        raise RecordingError(
            f"{name}: recording {what} (written{by or ' by an older torchtop'}); this torchtop reads formats "
            f"{_span(READ_FORMATS)} of wire protocols {_span(READ_PROTOCOLS)}: open it with "
            + (f"torchtop {writer}" if writer else "the torchtop version that wrote it")
        )
    return Header(version, protocol, writer)


def _span(versions: tuple[int, ...]) -> str:
    first, last = versions[0], versions[-1]  # before narrowing on len: pyright types a short tuple as ()
    return f"{first}-{last}" if len(versions) > 1 else str(first)


@dataclass
class Damage:
    """What a reader skipped in one segment: cut frames at its end, garbage inside."""

    cut_at: int | None = None  # offset of a frame cut short by the end of the file
    skipped: list[tuple[int, int]] = field(
        default_factory=list[tuple[int, int]]
    )  # (offset, bytes) of garbage skipped
    gave_up_at: int | None = None  # the resync's work bound was spent here: the rest is skipped

    def __bool__(self) -> bool:
        return self.cut_at is not None or bool(self.skipped)

    def skip(self, offset: int, n: int) -> None:
        if len(self.skipped) < 1000:  # a bounded note: the count and the first places say enough
            self.skipped.append((offset, n))
        else:
            last = self.skipped[-1]
            self.skipped[-1] = (last[0], offset + n - last[0])

    def line(self, name: str) -> str:
        """One warning line for the segment."""
        parts: list[str] = []
        if self.skipped:
            total = sum(n for _, n in self.skipped)
            parts.append(
                f"{total} damaged bytes skipped in {len(self.skipped)} place(s), first at offset {self.skipped[0][0]}"
            )
        if self.gave_up_at is not None:
            parts.append(f"too damaged to search past offset {self.gave_up_at}")
        if self.cut_at is not None:
            parts.append(f"cut mid-frame at offset {self.cut_at} (its last frame is lost)")
        return f"{name}: " + "; ".join(parts) + ": read up to and around the damage"


class _Scanner:
    """Frames of a segment's bytes, checked; CRC work on failed candidates bounded (RESYNC_WORK)."""

    def __init__(self, data: bytes | mmap.mmap, damage: Damage) -> None:
        self.data = data
        self.damage = damage
        self.n = len(data)
        self.budget = RESYNC_WORK * self.n + (1 << 20)

    def valid_at(self, pos: int, resync: bool = False) -> int | None:
        """The end of a whole, checked frame at `pos`, or None. `resync`: a candidate after
        garbage, checked only when another frame (or the file's end) follows where it ends, as
        the writer's frames do: a sync word inside garbage costs no CRC."""
        data = self.data
        if pos + FRAME_OVERHEAD > self.n:
            return None
        sync, length, crc = _FRAME.unpack_from(data, pos)
        end = pos + FRAME_OVERHEAD + length
        if sync != SYNC or length > wire.MAX_FRAME_BYTES or end > self.n:
            return None
        if resync and end != self.n and not SYNC.startswith(data[end : end + 4]):
            return None
        with memoryview(data) as view:
            ok = zlib.crc32(view[pos + FRAME_OVERHEAD : end]) == crc
        if not ok:
            self.budget -= length
        return end if ok else None

    def frames(self, start: int) -> Iterator[tuple[int, bytes]]:
        data, damage, n = self.data, self.damage, self.n
        pos = start
        while pos < n:
            end = self.valid_at(pos)
            if end is not None:
                yield pos, data[pos + FRAME_OVERHEAD : end]
                pos = end
                continue
            nxt = data.find(SYNC, pos + 1)
            while nxt != -1 and self.budget > 0 and self.valid_at(nxt, resync=True) is None:
                nxt = data.find(SYNC, nxt + 1)
            if nxt != -1 and self.budget > 0:
                damage.skip(pos, nxt - pos)
                pos = nxt
            elif nxt == -1 and _cut_short(data, pos):
                damage.cut_at = pos  # the writer was stopped mid-write: the usual end of a killed run
                return
            else:  # nothing good after it, or the search's work bound spent: garbage to the end
                if self.budget <= 0:
                    damage.gave_up_at = pos
                damage.skip(pos, n - pos)
                return


def scan(data: bytes, damage: Damage, start: int = HEADER_BYTES) -> Iterator[tuple[int, bytes]]:
    """(offset, payload) of each good frame in a segment's bytes, header excluded. Garbage is
    skipped to the next frame whose sync word, length and CRC check out, in linear time; a
    frame cut by the end of the data is noted in `damage.cut_at`."""
    return _Scanner(data, damage).frames(start)


def _cut_short(data: bytes | mmap.mmap, pos: int) -> bool:
    """A frame that starts well at `pos` but runs past the end of the data."""
    if len(data) - pos < FRAME_OVERHEAD:
        return SYNC.startswith(data[pos : pos + 4])
    sync, length, _ = _FRAME.unpack_from(data, pos)
    return sync == SYNC and length <= wire.MAX_FRAME_BYTES and pos + FRAME_OVERHEAD + length > len(data)


@dataclass
class Segment:
    """What reading one segment found besides its messages."""

    path: Path
    header: Header | None = None
    damage: Damage = field(default_factory=Damage)
    ended: bool = False  # its end marker was read: the writer closed it


def iter_segment(path: Path, seg: Segment) -> Iterator[tuple[int, wire.Hello | wire.Batch]]:
    """(offset, message) of every good message of one segment file, in order, read through a
    map of the file (memory: one message at a time). A frame whose payload does not decode as
    a wire message counts as damage. RecordingError: not a recording, or one this torchtop
    does not read; OSError: the file cannot be read."""
    from torchtop.contract.recording_compat import decoder_for

    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    with open(fd, "rb") as fh:  # non-blocking: a FIFO named like a segment must not hang a reader
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RecordingError(f"{path}: not a regular file")
        if st.st_size < HEADER_BYTES:
            seg.header = check_header(fh.read(HEADER_BYTES), str(path))
        mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    try:
        seg.header = check_header(mm[:HEADER_BYTES], str(path))
        decode = decoder_for(seg.header.protocol)
        for offset, payload in scan(mm, seg.damage):  # type: ignore[arg-type]
            if payload == END:
                seg.ended = True
                continue
            try:
                msg = decode(payload)
            except wire.WireError:
                seg.damage.skip(offset, FRAME_OVERHEAD + len(payload))
                continue
            if isinstance(msg, (wire.Hello, wire.Batch)):
                yield offset, msg
            else:
                seg.damage.skip(offset, FRAME_OVERHEAD + len(payload))
    finally:
        mm.close()


def read_frame(mm: bytes | mmap.mmap, offset: int, protocol: int) -> wire.Hello | wire.Batch:
    """The message of the frame at `offset` (one iter_segment returned): its payload decoded
    again, for a reader that keeps offsets rather than messages."""
    from torchtop.contract.recording_compat import decoder_for

    _, length, _ = _FRAME.unpack_from(mm, offset)
    msg = decoder_for(protocol)(mm[offset + FRAME_OVERHEAD : offset + FRAME_OVERHEAD + length])
    assert isinstance(msg, (wire.Hello, wire.Batch))
    return msg


def read_segment(path: Path) -> tuple[list[wire.Hello | wire.Batch], Damage]:
    """Every good message of one segment file, in order, and what was skipped (tests, tools)."""
    seg = Segment(path)
    return [m for _, m in iter_segment(path, seg)], seg.damage


class SegmentWriter:
    """Appends frames to a new segment file (0600, created exclusively in a verified directory,
    never through a link), each in a single write(): a frame is in the kernel's hands when
    `append` returns, so a killed process loses nothing it appended. `close` ends it with the
    end marker."""

    def __init__(self, dir_fd: int, directory: Path, name: str) -> None:
        """FileExistsError when the name is taken by anything (two writers never share a segment)."""
        self.path = directory / name
        self._fd = create_file(dir_fd, name)
        self.size = 0
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
                self._write(frame(END))
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
