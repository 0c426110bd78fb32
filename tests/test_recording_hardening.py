"""Readers that survive any file (issue 26): numbers refused once at decode, a linear resync, an
end marker that tells a cut run from a finished one, memory bounded whatever the run's length."""

from __future__ import annotations

import gzip
import json
import math
import os
import signal
import subprocess
import sys
import tracemalloc
import zlib
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from tests.recording_util import T0, batch, hello, write
from torchtop.contract import logcodes, wire
from torchtop.contract import recording as rec
from torchtop.contract import recording_store as store
from torchtop.monitor.commands.cli import main
from torchtop.monitor.model.playback import load

NAN, INF = float("nan"), float("inf")


# -- numbers: refused once, at the decode the live path shares -----------------------------------
@pytest.mark.parametrize(
    "bad",
    [
        {"time": NAN},
        {"time": INF},
        {"wall_offset": NAN},
        {"wall_offset": 1e300},
        {"telemetry": wire.Telemetry(time=-INF)},
        {
            "telemetry": wire.Telemetry(
                time=T0, host=wire.HostSample(proc_cpu=NAN, proc_rss=1, threads=1, cpu_count=1)
            )
        },
        {"log": [wire.LogChunk(0, 1, [(1 << 40 | logcodes.STEP_EVENT, NAN)])]},
    ],
    ids=["time-nan", "time-inf", "offset-nan", "offset-huge", "telemetry-inf", "host-nan", "device-ms-nan"],
)
def test_a_non_finite_or_huge_number_is_refused_at_decode(bad: dict[str, object]) -> None:
    good = batch(0)
    wire.decode(wire.encode(good))
    frame = wire.encode(msgspec.structs.replace(good, **bad))
    with pytest.raises(wire.WireError, match="must be finite"):
        wire.decode(frame)


def test_a_users_nan_mark_is_kept() -> None:
    """A diverged loss is news: the mark's value passes, its stamp is still checked."""
    entries: list[logcodes.Item] = [(1 << 40 | logcodes.MARK, "loss", NAN)]
    ok = msgspec.structs.replace(batch(0), log=[wire.LogChunk(0, 0, entries, False)])
    got = wire.decode(wire.encode(ok))
    assert isinstance(got, wire.Batch)
    mark = got.log[0].entries[0]
    assert isinstance(mark, tuple) and math.isnan(mark[2])
    pairs = msgspec.structs.replace(
        batch(0), log=[wire.LogChunk(0, 0, [5, (logcodes.MARK, "loss", INF)], True)]
    )
    assert isinstance(wire.decode(wire.encode(pairs)), wire.Batch)


def test_a_capture_summarys_free_form_nan_does_not_cost_the_batch() -> None:
    """Every batch carries the last capture: a profiler's 0/0 in its summary must not lose them all."""
    capture = wire.CaptureInfo(
        id=1, kind=wire.CaptureKind.PROFILE, state=wire.CaptureState.DONE, summary={"share": NAN}
    )
    got = wire.decode(wire.encode(msgspec.structs.replace(batch(0), capture=capture)))
    assert isinstance(got, wire.Batch) and got.capture is not None
    with pytest.raises(wire.WireError, match=r"capture\.started_at = nan"):
        wire.decode(
            wire.encode(
                msgspec.structs.replace(batch(0), capture=msgspec.structs.replace(capture, started_at=NAN))
            )
        )


def _recording_with(tmp_path: Path, bad: list[wire.Batch]) -> Path:
    """A segment of good batches with `bad` ones between them, every frame with a valid CRC."""
    data = rec.header() + rec.frame(wire.encode(hello()))
    for k in range(30):
        data += rec.frame(wire.encode(batch(k)))
        if k == 10:
            for b in bad:
                data += rec.frame(wire.encode(b))
    data += rec.frame(rec.END)
    path = tmp_path / "rank0" / "full-000000.ttrec"
    path.parent.mkdir(parents=True)
    path.write_bytes(data)
    return tmp_path


NAN_BATCHES = [
    msgspec.structs.replace(batch(11), wall_offset=NAN),
    msgspec.structs.replace(batch(11), time=INF),
    msgspec.structs.replace(batch(11), telemetry=wire.Telemetry(time=NAN)),
    msgspec.structs.replace(batch(11), wall_offset=1e300),
]


def test_nan_frames_in_a_recording_cost_one_line_in_every_reader(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _recording_with(tmp_path, NAN_BATCHES)
    pb, _ = load(path)
    assert len(pb.warnings) == 1 and "damaged bytes skipped in 4 place(s)" in pb.warnings[0], pb.warnings
    assert [s.i for p in pb.play() for s in p.steps] == list(range(300))
    assert main(["report", str(path), "--history"]) == 0
    assert main(["compare", str(path), str(path)]) == 0
    out = tmp_path / "t.json"
    assert main(["trace", str(path), "-o", str(out)]) == 0
    assert json.loads(out.read_text())["traceEvents"]
    err = capsys.readouterr().err
    assert "Traceback" not in err and "damaged bytes" in err


# -- resync: linear, bounded ---------------------------------------------------------------------
class CrcCount:
    def __init__(self) -> None:
        self.bytes = 0

    def crc32(self, data: bytes, value: int = 0) -> int:
        self.bytes += len(data)
        return zlib.crc32(data, value)


def _sync_storm(n: int, length: int) -> bytes:
    """Sync words every 12 bytes, each claiming a `length`-byte frame with a wrong CRC."""
    one = rec.SYNC + length.to_bytes(4, "little") + (12345).to_bytes(4, "little")
    return (one * (n // 12 + 1))[:n]


@pytest.mark.parametrize("length", [65_532, 4_000, 12])
def test_resync_work_is_linear_in_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, length: int
) -> None:
    """The issue's file (a sync word every 12 bytes): the CRC work stays within a few times the
    file's size (it was one CRC of the claimed length per sync word: quadratic)."""
    counter = CrcCount()
    monkeypatch.setattr(rec, "zlib", counter)
    size = 256 << 10
    path = tmp_path / "storm.ttrec"
    path.write_bytes(rec.header() + rec.frame(wire.encode(hello())) + _sync_storm(size, length))
    msgs, damage = rec.read_segment(path)
    assert len(msgs) == 1 and damage.skipped
    assert counter.bytes <= (rec.RESYNC_WORK + 1) * size + (1 << 20), counter.bytes


def test_frames_after_a_storm_of_random_sync_words_are_found(tmp_path: Path) -> None:
    """Sync words with random lengths cost no CRC (no frame follows where they end): the good
    frames after them are read."""
    write(tmp_path, 10)
    (segment,) = store.segments(tmp_path / "rank0", "full")
    data = segment.read_bytes()
    rng = __import__("random").Random(7)
    storm = b"".join(rec.SYNC + rng.randrange(1 << 20).to_bytes(4, "little") + bytes(4) for _ in range(5000))
    cut = rec.HEADER_BYTES + rec.FRAME_OVERHEAD + len(wire.encode(hello()))
    segment.write_bytes(data[:cut] + storm + data[cut:])
    pb, _ = load(tmp_path)
    assert [s.i for p in pb.play() for s in p.steps] == list(range(100))


def test_a_fifo_named_like_a_segment_does_not_hang_a_reader(tmp_path: Path) -> None:
    write(tmp_path, 3)
    os.mkfifo(tmp_path / "rank0" / "full-000001.ttrec")
    pb, _ = load(tmp_path)
    assert sum(len(p.steps) for p in pb.play()) == 30
    assert any("not a regular file" in w for w in pb.warnings), pb.warnings


# -- the end marker: a cut run says so, and where --------------------------------------------------
def test_a_closed_recording_has_no_cut_warning_across_rotations(tmp_path: Path) -> None:
    write(tmp_path, 400, max_bytes=store.MIN_MAX_BYTES)
    assert len(store.segments(tmp_path / "rank0", "full")) > 2
    for seg in store.segments(tmp_path / "rank0", "full"):
        assert seg.read_bytes().endswith(rec.frame(rec.END))
    pb, _ = load(tmp_path)
    assert not any("cut" in w for w in pb.warnings), pb.warnings


KILLED = r"""
import os, signal, sys
sys.path.insert(0, sys.argv[2])
from tests.recording_util import batch, hello
from torchtop.contract.recording_store import RecordingWriter
w = RecordingWriter(sys.argv[1], 0)
w.write(hello())
for k in range(40):
    w.write(batch(k))
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_writer_reads_as_cut_with_where(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", KILLED, str(tmp_path), str(root)], capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    assert main(["report", str(tmp_path), "--history"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    cut = [line for line in err if "recording cut at" in line]
    assert len(cut) == 1 and "after step 400" in cut[0] and "no end marker: the run was killed?" in cut[0], (
        err
    )
    assert "3.9 s in" in cut[0], cut  # the last batch's time, from the first


@pytest.mark.parametrize("at", [9e14, -9e14])
def test_a_cut_recording_whose_clock_is_past_any_calendar_still_says_where(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], at: float
) -> None:
    data = rec.header() + rec.frame(wire.encode(hello()))
    for k in range(5):
        data += rec.frame(wire.encode(msgspec.structs.replace(batch(k), time=at + k)))
    path = tmp_path / "rank0" / "full-000000.ttrec"
    path.parent.mkdir(parents=True)
    path.write_bytes(data)  # no end marker
    assert main(["report", str(tmp_path), "--history"]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and "recording cut at" in err, err


# -- memory: bounded by what is shown, not by the run's length -----------------------------------
def _peak(fn: Callable[..., object], *args: object) -> int:
    tracemalloc.start()
    try:
        fn(*args)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.slow  # traces 750 steps under tracemalloc; among the fast subset's slowest, ~8.1 s here (issue 27: the subset under 60 s)
def test_trace_memory_does_not_grow_with_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Four times the steps, about the same peak: the trace is streamed, the reader keeps an
    index (it took ~1.3 KB a step)."""
    peaks = []
    for n in (150, 600):
        path = tmp_path / f"r{n}"
        write(path, n, steps_per_chunk=20)
        out = tmp_path / f"r{n}.json.gz"
        peaks.append(_peak(main, ["trace", str(path), "-o", str(out)]))
        assert len(json.loads(gzip.decompress(out.read_bytes()))["traceEvents"]) > n * 20
    small, big = peaks
    assert big < small * 1.5 + (256 << 10), peaks  # 9,000 more steps: not ~12 MB more


def _read_all(path: Path) -> int:
    from torchtop.contract.recording_reader import read_rank

    return sum(1 for _ in read_rank(path).messages)


@pytest.mark.slow  # reads 750 steps under tracemalloc; among the fast subset's slowest, ~0.7 s here (issue 27: the subset under 60 s)
def test_reader_memory_is_bounded_by_an_index(tmp_path: Path) -> None:
    """The reader holds an index of the messages, not them: reading a recording 4x as long
    costs about the same (the report's state keeps its own bounded history)."""
    peaks = []
    for n in (150, 600):
        path = tmp_path / f"r{n}"
        write(path, n, steps_per_chunk=20)
        peaks.append(_peak(_read_all, path / "rank0"))
    small, big = peaks
    assert big < small + (128 << 10), peaks
