"""A recording on disk: a directory of segment files (recording.py), bounded in size.

    PATH/rank0/full-000000.ttrec   every frame, in segments of `segment_bytes`
    PATH/rank0/thin-000000.ttrec   the same run thinned: one step per chunk, telemetry <= 1 Hz
    PATH/rank1/...                 one directory per rank of a job

Each segment opens with the run's Hello. When the full track outgrows its share of the bound
(90%), its oldest segment is deleted; the thin track (10%) goes the same way, much later: what
is left is every step of the recent past and one step per tick of a longer past before it. A
reader splices them: the thin frames from before the oldest full segment, then the full ones.

A directory that already holds a recording gets the new run's segments after the old ones; a
reader reads the last run (and says so). Imports only msgspec (through wire) and the stdlib.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from torchtop.agent.contract import wire
from torchtop.agent.contract.recording import (
    SUFFIX,
    RecordingError,
    SegmentWriter,
    Thinner,
    read_segment,
)

DEFAULT_MAX_BYTES = 1 << 30  # 1 GiB a rank
MIN_MAX_BYTES = 64 << 10
FULL_SHARE = 0.9
MAX_SEGMENT_BYTES = 64 << 20
SEGMENTS = 8  # a track's share is cut into about this many segments: the oldest goes at a time
_NAME = re.compile(r"^(full|thin)-(\d{6})" + re.escape(SUFFIX) + "$")
_RANK = re.compile(r"^rank(\d+)$")


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

    def __init__(self, directory: Path, name: str, budget: int) -> None:
        self.directory = directory
        self.name = name
        self.budget = budget
        self.segment_bytes = max(4096, min(MAX_SEGMENT_BYTES, budget // SEGMENTS))
        old = segments(directory, name)
        self.sizes = {p: p.stat().st_size for p in old}
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
            path = self.directory / f"{self.name}-{self.next_index:06d}{SUFFIX}"
            self.next_index += 1
            try:
                self.current = SegmentWriter(path, exclusive=True)
                break
            except FileExistsError:
                continue
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
                oldest.unlink()
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
        self.directory = rank_dir(Path(path), rank)
        self.directory.mkdir(parents=True, exist_ok=True)
        max_bytes = max(MIN_MAX_BYTES, max_bytes)
        self.full = _Track(self.directory, "full", int(max_bytes * FULL_SHARE))
        self.thin = _Track(self.directory, "thin", max_bytes - self.full.budget)
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

    def close(self) -> None:
        self.full.close()
        self.thin.close()


# -- reading -------------------------------------------------------------------------------------
@dataclass
class RankRecording:
    """One rank's messages in order (the thin past spliced before the full recent past), and a
    warning line for each damaged segment or other oddity."""

    directory: Path
    messages: list[wire.Hello | wire.Batch] = field(default_factory=list[wire.Hello | wire.Batch])
    warnings: list[str] = field(default_factory=list[str])
    thinned_until: float | None = None  # batches before this time are thinned (one step a tick)

    @property
    def hello(self) -> wire.Hello | None:
        return next((m for m in reversed(self.messages) if isinstance(m, wire.Hello)), None)


def is_recording(path: Path) -> bool:
    """A segment file, a rank's directory, or a job's directory of rank directories."""
    path = Path(path)
    if path.is_file():
        return path.suffix == SUFFIX
    return path.is_dir() and bool(ranks(path) or segments(path, "full") or segments(path, "thin"))


def ranks(path: Path) -> dict[int, Path]:
    """A job recording's rank directories (rank -> directory); {} for a single rank's."""
    out: dict[int, Path] = {}
    try:
        names = os.listdir(path)
    except OSError:
        return {}
    for name in names:
        m = _RANK.match(name)
        if m and (path / name).is_dir():
            out[int(m.group(1))] = path / name
    return dict(sorted(out.items()))


def _read_track(files: list[Path], warn: Callable[[str], None]) -> list[wire.Hello | wire.Batch]:
    out: list[wire.Hello | wire.Batch] = []
    for f in files:
        try:
            msgs, damage = read_segment(f)
        except FileNotFoundError:  # rotated away while we listed it
            continue
        except RecordingError as exc:
            warn(str(exc))
            continue
        if damage:
            warn(damage.line(str(f)))
        out.extend(msgs)
    return out


def _last_run(msgs: list[wire.Hello | wire.Batch]) -> tuple[list[wire.Hello | wire.Batch], int]:
    """The messages of the last run among `msgs`, and how many runs there were."""
    runs, start, run_id = 0, 0, None
    for k, m in enumerate(msgs):
        if m.run_id != run_id:
            runs, start, run_id = runs + 1, k, m.run_id
    return msgs[start:], runs


def read_rank(path: Path) -> RankRecording:
    """One rank's recording: a rank directory or one segment file. RecordingError when there
    is nothing readable in it."""
    path = Path(path)
    rec = RankRecording(path)
    if path.is_file():
        try:
            rec.messages, damage = read_segment(path)
        except OSError as exc:
            raise RecordingError(f"cannot read {path}: {exc.strerror or exc}") from None
        if damage:
            rec.warnings.append(damage.line(str(path)))
    else:
        full = _read_track(segments(path, "full"), rec.warnings.append)
        thin = _read_track(segments(path, "thin"), rec.warnings.append)
        start = next((m.time for m in full if isinstance(m, wire.Batch)), None)
        if start is not None and thin:
            cut = next(
                (k for k, m in enumerate(thin) if isinstance(m, wire.Batch) and m.time >= start), len(thin)
            )
            older = thin[:cut]  # the thin track up to where the full one starts
            if any(isinstance(m, wire.Batch) for m in older):
                rec.thinned_until = start
                full = older + full
        rec.messages = full or thin
    rec.messages, runs = _last_run(rec.messages)
    if runs > 1:
        rec.warnings.append(
            f"{path} holds {runs} runs; reading the last one (record each run into its own directory)"
        )
    if not any(isinstance(m, wire.Batch) for m in rec.messages):
        raise RecordingError(
            f"{path}: no recorded batches in it" + (f" ({rec.warnings[0]})" if rec.warnings else "")
        )
    return rec


def open_recording(path: Path) -> dict[int, Path]:
    """The ranks of a recording (rank -> what `read_rank` reads). RecordingError when `path`
    is not one."""
    path = Path(path)
    if not path.exists():
        raise RecordingError(f"{path}: no such file or directory")
    if not is_recording(path):
        raise RecordingError(
            f"{path}: not a torchtop recording (no {SUFFIX} segments, no rank*/ directories)"
        )
    found = ranks(path)
    if found:
        return found
    return {_rank_of(path): path}


def _rank_of(path: Path) -> int:
    m = _RANK.match(path.name if path.is_dir() else path.parent.name)
    return int(m.group(1)) if m else 0
