"""A recording on disk: a directory of segment files (recording.py), bounded in size; the writing side
(recording_reader.py reads it).

    PATH/rank0/full-000000.ttrec   every frame, in segments of `segment_bytes`
    PATH/rank0/thin-000000.ttrec   the same run thinned: one step per chunk, telemetry <= 1 Hz
    PATH/rank1/...                 one directory per rank of a job

Each segment opens with the run's Hello. When the full track outgrows its share of the bound
(90%), its oldest segment is deleted; the thin track (10%) goes the same way, much later: what
is left is every step of the recent past and one step per tick of a longer past before it. A
reader splices them: the thin frames from before the oldest full segment, then the full ones.

A directory that already holds a recording gets the new run's segments after the old ones; a
reader reads the last run (and says so).

Private like captures (docs/security.md): PATH must be a directory of this user that nobody else
can write (created 0700; a symlink of another user, or their directory, is refused and never
followed), its rank directory is created 0700 (ours, narrowed), and each segment is created 0600
with O_EXCL|O_NOFOLLOW in the verified directory. When PATH cannot be used so, the recording
goes to <runtime dir>/recordings/NAME-PID instead and `note` says where and why.
Imports only msgspec (through wire) and the stdlib.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from torchtop.contract import discovery, wire
from torchtop.contract.private import NotPrivate, open_private_dir
from torchtop.contract.recording import SUFFIX, SegmentWriter, Thinner

DEFAULT_MAX_BYTES = 1 << 30  # 1 GiB a rank
MIN_MAX_BYTES = 64 << 10
FULL_SHARE = 0.9
MAX_SEGMENT_BYTES = 64 << 20
SEGMENTS = 8  # a track's share is cut into about this many segments: the oldest goes at a time
_NAME = re.compile(r"^(full|thin)-(\d{6,18})" + re.escape(SUFFIX) + "$")  # 6 digits, more past 999999
RANK_DIR = re.compile(r"^rank(\d+)$")


def rank_dir(path: Path, rank: int) -> Path:
    return path / f"rank{rank}"


def segments(directory: Path, track: str) -> list[Path]:
    """A track's segment files, oldest first."""
    found: list[tuple[int, Path]] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    for name in names:
        m = _NAME.match(name)
        if m and m.group(1) == track:
            found.append((int(m.group(2)), directory / name))
    return [p for _, p in sorted(found)]


class _Track:
    """One track's segments: rotated at `segment_bytes`, the oldest deleted over `budget`."""

    def __init__(self, dir_fd: int, directory: Path, name: str, budget: int) -> None:
        self.dir_fd = dir_fd
        self.directory = directory
        self.name = name
        self.budget = budget
        self.segment_bytes = max(4096, min(MAX_SEGMENT_BYTES, budget // SEGMENTS))
        old = segments(directory, name)
        self.sizes = {p: os.stat(p.name, dir_fd=dir_fd, follow_symlinks=False).st_size for p in old}
        self.next_index = (int(_NAME.match(old[-1].name).group(2)) + 1) if old else 0  # type: ignore[union-attr]
        self.current: SegmentWriter | None = None

    def append(self, payload: bytes, hello: bytes | None) -> None:
        cur = self.current
        if cur is None or cur.size >= self.segment_bytes:
            cur = self._rotate(hello)
        cur.append(payload)
        self.sizes[cur.path] = cur.size

    def _rotate(self, hello: bytes | None) -> SegmentWriter:
        if self.current is not None:
            self.current.close()
        while True:  # another writer in the same directory (a second process of this rank) skips ahead
            name = f"{self.name}-{self.next_index:06d}{SUFFIX}"
            self.next_index += 1
            try:
                self.current = SegmentWriter(self.dir_fd, self.directory, name)
                break
            except FileExistsError:
                continue
        path = self.current.path
        if hello is not None:  # every segment can be read on its own
            self.current.append(hello)
        self.sizes[path] = self.current.size
        self._trim()
        return self.current

    def _trim(self) -> None:
        while sum(self.sizes.values()) > self.budget and len(self.sizes) > 1:
            oldest = next(iter(self.sizes))
            del self.sizes[oldest]
            try:
                os.unlink(oldest.name, dir_fd=self.dir_fd)
            except OSError:
                pass

    def close(self) -> None:
        if self.current is not None:
            self.current.close()
            self.current = None


class RecordingWriter:
    """Writes one rank's recording: every message to the full track, a thinned copy to the thin
    track. Synchronous; the agent runs it on its recorder thread (agent/loop/recorder.py), a
    monitor on its feed thread. OSError propagates: the caller says so once and stops."""

    def __init__(self, path: Path, rank: int = 0, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.note = ""  # where the recording went instead of `path`, and why ("" when there)
        self.directory, self._fd = self._open(Path(os.path.abspath(path)), rank)
        max_bytes = max(MIN_MAX_BYTES, max_bytes)
        try:
            self.full = _Track(self._fd, self.directory, "full", int(max_bytes * FULL_SHARE))
            self.thin = _Track(self._fd, self.directory, "thin", max_bytes - self.full.budget)
        except BaseException:  # broad: closes the descriptor on any exit, then re-raises
            os.close(self._fd)
            raise
        self.thinner = Thinner()
        self.hello: bytes | None = None
        self.frames = 0

    def write(self, msg: wire.Hello | wire.Batch, payload: bytes | None = None) -> None:
        """Append `msg` (`payload`: its encoding, when the caller has it already)."""
        payload = wire.encode(msg) if payload is None else payload
        if isinstance(msg, wire.Hello):
            if payload == self.hello:
                return
            self.hello = payload
            self.full.append(payload, None)
            self.thin.append(payload, None)
            return
        self.full.append(payload, self.hello)
        thin = self.thinner.thin(msg)
        if thin is not None:
            self.thin.append(wire.encode(thin), self.hello)
        self.frames += 1

    def _open(self, path: Path, rank: int) -> tuple[Path, int]:
        """The rank's directory, verified private, and its descriptor; the fallback with a note
        when `path` is not ours alone. OSError when neither can be used."""
        try:
            return rank_dir(path, rank), _open_rank_dir(path, rank)
        except NotPrivate as exc:
            reason = str(exc)
        fallback = discovery.runtime_dir() / "recordings" / f"{path.name or 'recording'}-{os.getpid()}"
        os.close(discovery.open_runtime_dir())  # ours, 0700
        fd = _open_rank_dir(fallback, rank)
        self.note = (
            f"recording to {rank_dir(fallback, rank)} instead: {reason}; record into a directory of yours "
            "that only you can write"
        )
        return rank_dir(fallback, rank), fd

    def close(self) -> None:
        """Ends both tracks' segments with the end marker: a reader knows the run was not cut."""
        self.full.close()
        self.thin.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _open_rank_dir(path: Path, rank: int) -> int:
    """PATH (created 0700; a symlink of ours is followed, another user's refused) and its rank
    directory (created 0700, narrowed, never a link), as a descriptor of the latter."""
    os.close(open_private_dir(path, create=True, own_symlink=True))
    return open_private_dir(rank_dir(path, rank), create=True, narrow=True, own_symlink=False)
