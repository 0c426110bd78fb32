"""The recording format (agent/contract/recording.py, recording_store.py): frames, damage, bounds."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.recording_util import T0, batch, hello, write
from torchtop.contract import logcodes, wire
from torchtop.contract import recording as rec
from torchtop.contract import recording_reader as reader
from torchtop.contract import recording_store as store
from torchtop.contract.recording_reader import read_rank
from torchtop.monitor.model.playback import Playback, load, parse_when


def steps_of(path: Path) -> list[int]:
    pb, _ = load(path)
    return [s.i for p in pb.play() for s in p.steps]


def test_round_trip_every_step(tmp_path: Path) -> None:
    write(tmp_path, 50)
    pb, ranks = load(tmp_path)
    assert list(ranks) == [0] and pb.warnings == []
    assert pb.hello == hello()
    # the first chunk opens with the first step's start: its boundary closes step 0
    assert steps_of(tmp_path) == list(range(500))
    assert pb.steps_total == 500


def test_a_segment_file_opens_on_its_own(tmp_path: Path) -> None:
    write(tmp_path, 5)
    (segment,) = store.segments(tmp_path / "rank0", "full")
    assert segment.read_bytes()[: rec.HEADER_BYTES] == rec.header()
    assert steps_of(segment) == list(range(50))


def test_cut_mid_frame_opens_up_to_the_cut_with_one_warning(tmp_path: Path) -> None:
    write(tmp_path, 20)
    (segment,) = store.segments(tmp_path / "rank0", "full")
    data = segment.read_bytes()
    segment.write_bytes(data[: len(data) - 37])  # the writer killed inside its last write()
    pb, _ = load(tmp_path)
    assert len(pb.warnings) == 1 and "recording cut at" in pb.warnings[0], pb.warnings
    assert "mid-frame" in pb.warnings[0] and "no end marker" in pb.warnings[0]
    assert steps_of(tmp_path) == list(range(190))  # the last batch's ten steps are lost, no more


def test_garbage_inside_is_skipped_with_one_warning(tmp_path: Path) -> None:
    write(tmp_path, 20)
    (segment,) = store.segments(tmp_path / "rank0", "full")
    data = bytearray(segment.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = os.urandom(64)
    segment.write_bytes(bytes(data))
    pb, _ = load(tmp_path)
    assert len(pb.warnings) == 1 and "damaged bytes skipped" in pb.warnings[0], pb.warnings
    got = steps_of(tmp_path)
    # one or two frames around the damage are lost; every step before and after is read
    assert 150 <= len(got) < 200 and got[:60] == list(range(60)) and got[-50:] == list(range(150, 200))


def test_another_format_version_is_refused_with_what_to_do(tmp_path: Path) -> None:
    write(tmp_path, 2)
    (segment,) = store.segments(tmp_path / "rank0", "full")
    data = bytearray(segment.read_bytes())
    data[8] = rec.FORMAT_VERSION + 1
    segment.write_bytes(bytes(data))
    with pytest.raises(
        rec.RecordingError,
        match=r"recording format 3 \(written by torchtop .*\); this torchtop .* reads formats 1-2 .*: install torchtop>=",
    ):
        rec.read_segment(segment)
    with pytest.raises(rec.RecordingError, match="no such file"):
        load(tmp_path / "nowhere")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(rec.RecordingError, match="not a torchtop recording"):
        load(tmp_path / "notes.txt")
    (tmp_path / "notes.ttrec").write_text("hello, this is text")
    with pytest.raises(rec.RecordingError, match="not a torchtop recording"):
        load(tmp_path / "notes.ttrec")


@pytest.mark.slow
def test_size_is_bounded_and_the_past_is_thinned(tmp_path: Path) -> None:
    """Far more than the bound written: the directory stays near it; the recent past has every
    step, the older past one step per batch (the thin track)."""
    bound = 512 << 10
    write(tmp_path, 2000, max_bytes=bound, steps_per_chunk=400)
    files = list((tmp_path / "rank0").iterdir())
    total = sum(f.stat().st_size for f in files)
    assert total <= bound * 1.15, (total, sorted(f.name for f in files))
    assert store.segments(tmp_path / "rank0", "full")[0].name != "full-000000.ttrec"  # the oldest went
    pb, _ = load(tmp_path)
    until = pb.recording.thinned_until
    assert until is not None
    played = [(p.msg.time, p.steps) for p in pb.play() if isinstance(p.msg, wire.Batch)]
    thinned = [s for t, steps in played if t < until for s in steps]
    recent = [s.i for t, steps in played if t >= until for s in steps]
    thin_batches = sum(1 for t, _ in played if t < until)
    assert thinned and recent and len(thinned) <= thin_batches  # at most one step a batch back there
    assert recent == list(range(recent[0], 800_000))  # every step since, up to the newest
    assert recent[0] - thinned[0].i > 5 * len(recent)  # the thin past reaches much further back


def test_a_second_run_in_the_same_directory_reads_the_last(tmp_path: Path) -> None:
    write(tmp_path, 3)
    w = store.RecordingWriter(tmp_path, 0)
    w.write(hello("run-b"))
    for k in range(2):
        b = batch(k, run_id="run-b")
        b.time += 60  # the second run starts later
        w.write(b)
    w.close()
    pb, _ = load(tmp_path)
    assert pb.hello is not None and pb.hello.run_id == "run-b"
    assert [s.i for p in pb.play() for s in p.steps] == list(range(20))
    assert len(pb.warnings) == 1 and "holds 2 runs" in pb.warnings[0]


def test_job_recording_lists_its_ranks(tmp_path: Path) -> None:
    for r in (0, 1):
        w = store.RecordingWriter(tmp_path, r)
        w.write(hello(rank=r))
        w.write(batch(0, rank=r))
        w.close()
    pb, ranks = load(tmp_path, rank=1)
    assert sorted(ranks) == [0, 1] and pb.hello is not None and pb.hello.rank == 1
    with pytest.raises(rec.RecordingError, match="no rank 5"):
        load(tmp_path, rank=5)


def test_playback_index_by_time_and_step(tmp_path: Path) -> None:
    write(tmp_path, 30)
    pb = Playback(reader.read_rank(tmp_path / "rank0"))
    assert pb.start == T0 and pb.end == pytest.approx(T0 + 2.9)
    assert pb.time_of_step(105) == pytest.approx(T0 + 1.0)  # batch 10 holds steps 100..109
    state = pb.state_until(T0 + 1.0)
    assert state.steps[-1].i == 109 - 1  # the newest step is held for a mark, as live
    assert parse_when("1:30") == 90 and parse_when("2m") == 120 and parse_when("250ms") == 0.25


def test_thinning_keeps_small_chunks_whole() -> None:
    small = batch(0, steps_per_chunk=3)
    assert rec.thin_chunk(small.log[0]) is small.log[0]
    big = batch(0, steps_per_chunk=50).log[0]
    thin = rec.thin_chunk(big)
    assert thin is not None and thin.entries[:2] == [0, logcodes.RESET]
    assert logcodes.count_step_ends(thin.entries[1::2]) == 2  # opens one step and closes it


def test_unbuffered_writes_reach_the_file_before_close(tmp_path: Path) -> None:
    """Each frame is one write(): readable at once, as after a kill."""
    w = store.RecordingWriter(tmp_path, 0)
    w.write(hello())
    w.write(batch(0))
    assert steps_of(tmp_path) == list(range(10))
    w.close()


def test_played_a_few_messages_at_a_time_loses_no_step(tmp_path: Path) -> None:
    """The replay TUI plays a few messages per call with its own LogReplay: every step arrives,
    as when the recording is played in one go."""
    from torchtop.monitor.model.log_replay import LogReplay

    write(tmp_path, 30)
    pb = Playback(read_rank(tmp_path / "rank0"))
    whole = [s.i for p in pb.play() for s in p.steps]
    replay, parts = LogReplay(), []
    for k in range(0, len(pb.messages), 8):
        parts += [s.i for p in pb.play(k, k + 8, replay) for s in p.steps]
    assert parts == whole and len(whole) >= 29 * 10
