"""Reading a recording (recording_store.py writes it): one rank's messages, in memory bounded by
an index, whatever the run's length.

One pass reads every segment of a rank (each frame checked and decoded once, then dropped) and
keeps, per message, where its frame is (segment, offset), its batch time and the agent's step
count after it: ~31 bytes a message (a batch is ~0.1-0.5 s of the run), not the messages. A
reader then takes messages in order (`RankRecording.messages`, a lazy sequence that decodes each
frame again from a map of its file) and keeps only what it shows.

The thin past is spliced before the full recent past; of several runs in one directory the last
is read (and said). A recording whose newest segment has no end marker was cut: a warning says
where (format 2; format 1 had no marker). Imports only msgspec (through wire) and the stdlib.
"""

from __future__ import annotations

import mmap
import os
import time
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import overload

from torchtop.contract import wire
from torchtop.contract.recording import SUFFIX, RecordingError, Segment, iter_segment, read_frame
from torchtop.contract.recording_store import RANK_DIR, segments

NO_TIME = float("-inf")  # a hello's entry in `times`


@dataclass
class _Index:
    """Per message: its segment, offset, batch time (NO_TIME: a hello), step count and run."""

    seg: array[int] = field(default_factory=lambda: array("I"))
    off: array[int] = field(default_factory=lambda: array("Q"))
    times: array[float] = field(default_factory=lambda: array("d"))
    steps: array[int] = field(default_factory=lambda: array("q"))
    run: array[int] = field(default_factory=lambda: array("I"))

    def __len__(self) -> int:
        return len(self.seg)

    def slice(self, lo: int, hi: int) -> _Index:
        return _Index(self.seg[lo:hi], self.off[lo:hi], self.times[lo:hi], self.steps[lo:hi], self.run[lo:hi])

    def extend(self, other: _Index) -> None:  # one by one: the times are floats, the rest ints
        self.seg.extend(other.seg)
        self.off.extend(other.off)
        self.times.extend(other.times)
        self.steps.extend(other.steps)
        self.run.extend(other.run)


class Messages(Sequence[wire.Hello | wire.Batch]):
    """A rank's messages, decoded on demand from their files (a map of the one being read)."""

    def __init__(self, files: list[Segment], index: _Index) -> None:
        self._files = files
        self._index = index
        self._open: tuple[int, mmap.mmap] | None = None

    def __len__(self) -> int:
        return len(self._index)

    @overload
    def __getitem__(self, k: int) -> wire.Hello | wire.Batch: ...
    @overload
    def __getitem__(self, k: slice) -> list[wire.Hello | wire.Batch]: ...
    def __getitem__(self, k: int | slice) -> wire.Hello | wire.Batch | list[wire.Hello | wire.Batch]:
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        if k < 0:
            k += len(self)
        seg = self._index.seg[k]
        if self._open is None or self._open[0] != seg:
            self.close()
            with open(self._files[seg].path, "rb") as fh:
                self._open = (seg, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ))
        header = self._files[seg].header
        assert header is not None
        return read_frame(self._open[1], self._index.off[k], header.protocol)

    def __iter__(self) -> Iterator[wire.Hello | wire.Batch]:
        for k in range(len(self)):
            yield self[k]

    def close(self) -> None:
        if self._open is not None:
            self._open[1].close()
            self._open = None


@dataclass
class RankRecording:
    """One rank's recording: its messages in order (lazy), the index's times and step counts,
    and a warning line for each damaged segment or other oddity."""

    directory: Path
    messages: Sequence[wire.Hello | wire.Batch] = ()
    warnings: list[str] = field(default_factory=list[str])
    thinned_until: float | None = None  # batches before this time are thinned (one step a tick)
    hello: wire.Hello | None = None  # the last run's last hello
    times: Sequence[float] = ()  # per message: its batch time (NO_TIME: a hello)
    step_counts: Sequence[int] = ()  # per message: the agent's step count after it
    cut: str = ""  # where the recording was cut ("" when its end marker was read)


def is_recording(path: Path) -> bool:
    """A segment file, a rank's directory, or a job's directory of rank directories."""
    path = Path(path)
    if path.is_file():
        return path.suffix == SUFFIX
    return path.is_dir() and bool(ranks(path) or segments(path, "full") or segments(path, "thin"))


def ranks(path: Path) -> dict[int, Path]:
    """A job recording's rank directories (rank -> directory); {} for a single rank's."""
    return rank_dirs(path)[0]


MAX_RANK_DIGITS = 9  # a rank of a billion is no job's


def rank_dirs(path: Path) -> tuple[dict[int, Path], list[str]]:
    """A job recording's rank directories, and a line for each entry named like one that is not
    read: not a directory (a file, a FIFO, a dangling link), or a second name of a rank already
    there (rank01 beside rank1: rank1 is read)."""
    out: dict[int, Path] = {}
    notes: list[str] = []
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return {}, []
    for name in names:
        m = RANK_DIR.match(name)
        if not m:
            continue
        where = path / name
        if len(m.group(1)) > MAX_RANK_DIGITS or not where.is_dir():
            notes.append(f"{where}: not a rank's directory; left out")
            continue
        r = int(m.group(1))
        other = out.get(r)
        if other is not None:
            keep, drop = (where, other) if name == f"rank{r}" else (other, where)
            out[r] = keep
            notes.append(f"rank {r} recorded twice ({keep.name}/ and {drop.name}/): {drop.name}/ left out")
            continue
        out[r] = where
    return dict(sorted(out.items())), notes


class _Reader:
    """The index pass over a rank's segment files."""

    def __init__(self) -> None:
        self.files: list[Segment] = []
        self.runs: list[str] = []  # run ids, by the index's `run` numbers
        self.warnings: list[str] = []

    def track(self, paths: list[Path]) -> tuple[_Index, list[Segment]]:
        index, read = _Index(), list[Segment]()
        for path in paths:
            seg = Segment(path)
            number = len(self.files)
            try:
                for offset, msg in iter_segment(path, seg):
                    if not self.runs or self.runs[-1] != msg.run_id:
                        self.runs.append(msg.run_id)
                    index.seg.append(number)
                    index.off.append(offset)
                    index.run.append(len(self.runs) - 1)
                    if isinstance(msg, wire.Batch):
                        index.times.append(msg.time)
                        index.steps.append(max((c.steps for c in msg.log), default=-1))
                    else:
                        index.times.append(NO_TIME)
                        index.steps.append(-1)
            except FileNotFoundError:  # rotated away while we listed it
                continue
            except RecordingError as exc:
                self.warnings.append(str(exc))
                continue
            except (OSError, ValueError) as exc:  # unreadable, or an empty file (mmap)
                self.warnings.append(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}")
                continue
            self.files.append(seg)
            read.append(seg)
            if seg.damage.skipped:  # a cut alone is said by read_rank, once
                self.warnings.append(seg.damage.line(str(path)))
        return index, read


def _first_batch(index: _Index) -> int | None:
    return next((k for k, t in enumerate(index.times) if t != NO_TIME), None)


def read_rank(path: Path) -> RankRecording:
    """One rank's recording: a rank directory or one segment file. RecordingError when there
    is nothing readable in it."""
    path = Path(path)
    reader = _Reader()
    rec = RankRecording(path)
    if path.is_file():
        index, read = reader.track([path])
        if not read and reader.warnings:
            raise RecordingError(reader.warnings[0])
        newest = read
    else:
        index, newest = reader.track(segments(path, "full"))
        thin, thin_read = reader.track(segments(path, "thin"))
        first = _first_batch(index)
        if first is None:
            index, newest = thin, thin_read
        elif len(thin):
            start = index.times[first]
            cut = next((k for k, t in enumerate(thin.times) if t != NO_TIME and t >= start), len(thin))
            older = thin.slice(0, cut)  # the thin track up to where the full one starts
            if _first_batch(older) is not None:
                rec.thinned_until = start
                older.extend(index)
                index = older
    rec.warnings = reader.warnings
    index = _last_run(index, rec, path, reader.runs)
    if _first_batch(index) is None:
        raise RecordingError(
            f"{path}: no recorded batches in it" + (f" ({rec.warnings[0]})" if rec.warnings else "")
        )
    rec.messages = Messages(reader.files, index)
    rec.times, rec.step_counts = index.times, _running_max(index.steps)
    last_hello = next((k for k in range(len(index) - 1, -1, -1) if index.times[k] == NO_TIME), None)
    hello = rec.messages[last_hello] if last_hello is not None else None
    rec.hello = hello if isinstance(hello, wire.Hello) else None
    for seg in reader.files:  # a cut segment that is not the newest: an earlier run was killed
        if seg.damage.cut_at is not None and not seg.damage.skipped and (not newest or seg is not newest[-1]):
            rec.warnings.append(seg.damage.line(str(seg.path)))
    last = newest[-1] if newest else None
    if (
        last is not None
        and last.header is not None
        and (last.header.format >= 2 or last.damage.cut_at is not None)
    ):
        if not last.ended:
            rec.cut = _cut_line(last, index, rec.step_counts)
            rec.warnings.append(rec.cut)
    return rec


def _last_run(index: _Index, rec: RankRecording, path: Path, runs: list[str]) -> _Index:
    """The messages of the last run (by run id) of `index`."""
    count, prev = 0, None
    for r in index.run:
        if runs[r] != prev:
            count, prev = count + 1, runs[r]
    if count <= 1:
        return index
    last = runs[index.run[-1]]
    start = len(index)
    while start > 0 and runs[index.run[start - 1]] == last:
        start -= 1
    rec.warnings.append(
        f"{path} holds {count} runs; reading the last one (record each run into its own directory)"
    )
    return index.slice(start, len(index))


def _running_max(steps: array[int]) -> array[int]:
    out, n = array("q"), 0
    for s in steps:
        n = max(n, s)
        out.append(n)
    return out


def _cut_line(seg: Segment, index: _Index, step_counts: Sequence[int]) -> str:
    segment = seg.path
    mid = f", mid-frame at offset {seg.damage.cut_at}" if seg.damage.cut_at is not None else ""
    last = next((k for k in range(len(index) - 1, -1, -1) if index.times[k] != NO_TIME), None)
    if last is None:
        return f"recording cut in {segment}{mid} (no end marker: the run was killed?)"
    first = index.times[_first_batch(index) or 0]
    at = index.times[last]
    try:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))
    except (OverflowError, OSError, ValueError):  # a time no calendar holds (a damaged clock)
        stamp = f"unix time {at:.1f}"
    return (
        f"recording cut at {stamp} ({at - first:.1f} s in, after step {step_counts[last]}) "
        f"in {segment}{mid} (no end marker: the run was killed?)"
    )


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
    m = RANK_DIR.match(path.name if path.is_dir() else path.parent.name)
    return int(m.group(1)) if m else 0
