"""Recordings of jobs that are not whole (issue 37): a job report, trace or replay reads the ranks
it can and notes the others (a rank that died before its first batch leaves an empty, header-only
or unreadable directory); a rank whose log yields no steps is said; rank directories of different
jobs or runs, or one rank twice, are said; every number of a log chunk is range-checked, so a
step count of 2**64 - 1 is damage skipped, never an OverflowError."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.recording_util import batch, hello, write
from torchtop.contract import recording as rec
from torchtop.contract import recording_store as store
from torchtop.contract import wire
from torchtop.contract.numbers import COUNT_MAX, bad_number
from torchtop.monitor.commands.cli import main
from torchtop.monitor.model.job_playback import JobPlayback
from torchtop.monitor.model.playback import load

N = 40  # batches a rank


def _job(path: Path, ranks: int = 2) -> Path:
    for r in range(ranks):
        write(path, N, rank=r)
    return path


def _empty(rank_dir: Path) -> None:
    shutil.rmtree(rank_dir)
    rank_dir.mkdir()


def _header_only(rank_dir: Path) -> None:
    for seg in rank_dir.iterdir():
        seg.write_bytes(rec.header())


def _fifos(rank_dir: Path) -> None:
    for seg in list(rank_dir.iterdir()):
        seg.unlink()
        os.mkfifo(seg)


def _link_to_empty(rank_dir: Path) -> None:
    shutil.rmtree(rank_dir)
    (rank_dir.parent.parent / "elsewhere").mkdir()
    rank_dir.symlink_to(rank_dir.parent.parent / "elsewhere")


def _dangling_link(rank_dir: Path) -> None:
    shutil.rmtree(rank_dir)
    rank_dir.symlink_to(rank_dir.parent.parent / "nowhere")


def _a_file(rank_dir: Path) -> None:
    shutil.rmtree(rank_dir)
    rank_dir.write_text("not a rank")


BROKEN: dict[str, Callable[[Path], None]] = {
    "empty": _empty,
    "header-only": _header_only,
    "FIFO segments": _fifos,
    "link to an empty directory": _link_to_empty,
    "dangling link": _dangling_link,
    "a file": _a_file,
}


@pytest.mark.parametrize("kind", list(BROKEN))
@pytest.mark.parametrize("broken", [0, 1])
def test_a_job_recording_with_a_broken_rank_reads_the_others_and_notes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str, broken: int
) -> None:
    path = _job(tmp_path / "job", 3)
    BROKEN[kind](path / f"rank{broken}")
    assert main(["report", str(path), "--history"]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    good = [r for r in (0, 1, 2) if r != broken]
    assert [r["rank"] for r in report["ranks"]] == good
    said = [line for line in err.splitlines() if f"rank{broken}" in line or f"rank {broken}" in line]
    assert said and "Traceback" not in err, err
    assert any(f"rank{broken}" in n or f"rank {broken}" in n for n in report["notes"]) or kind in (
        "dangling link",
        "a file",
    )
    played = JobPlayback({r: path / f"rank{r}" for r in (0, 1, 2) if (path / f"rank{r}").is_dir()})
    assert sorted(played.ranks) == good and any(
        str(broken) in w for w in played.warnings
    )  # what replay shows
    assert main(["trace", str(path), "-o", str(tmp_path / "t.json")]) == 0
    assert "2 ranks" in capsys.readouterr().err
    pb, _ = load(path)  # one rank of it (compare, replay --rank): the lowest that reads
    assert pb.hello is not None and pb.hello.rank == good[0]


def test_a_job_recording_no_rank_of_which_reads_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _job(tmp_path / "job")
    for r in (0, 1):
        _header_only(path / f"rank{r}")
    assert main(["report", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "no recorded batches" in err


def _rank_with(path: Path, rank: int, mutate: Callable[[wire.Batch], None], **hello_kw: object) -> None:
    w = store.RecordingWriter(path, rank)
    h = hello(rank=rank)
    for name, value in hello_kw.items():
        setattr(h, name, value)
    w.write(h)
    for k in range(N):
        b = batch(k, rank=rank)
        mutate(b)
        w.write(b)
    w.close()


def test_a_step_count_past_int64_is_damage_skipped_not_an_overflow(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "job"
    write(path, N, rank=0)

    def huge(b: wire.Batch) -> None:
        if b.seq == 20:
            c = b.log[0]
            b.log[0] = wire.LogChunk(c.seq, 2**64 - 1, c.entries, c.pairs)

    _rank_with(path, 1, huge)
    for argv in (
        ["report", str(path), "--history"],
        ["report", str(path), "--rank", "1", "--history"],
        ["trace", str(path), "-o", str(tmp_path / "t.json")],
        ["compare", str(path / "rank1"), str(path / "rank0")],
    ):
        assert main(argv) == 0, argv
        err = capsys.readouterr().err
        assert "Traceback" not in err and ("damaged bytes skipped" in err or argv[0] == "compare"), (
            argv,
            err,
        )
    played = JobPlayback({0: path / "rank0", 1: path / "rank1"})
    steps = {r: sum(len(p.steps) for p in pb.play()) for r, pb in played.ranks.items()}
    assert 0 < steps[0] - 20 <= steps[1] < steps[0]  # the chunk's steps (and the one open) left out
    assert len(played.job_until().ranked()) == 2


@pytest.mark.parametrize(
    ("chunk", "where"),
    [
        (wire.LogChunk(0, 2**64 - 1, [1, 2], False), ".steps"),
        (wire.LogChunk(0, COUNT_MAX + 1, [1, 2], False), ".steps"),
        (wire.LogChunk(-1, 5, [1, 2], False), ".seq"),
        (wire.LogChunk(2**63, 5, [1, 2], False), ".seq"),
        (wire.LogChunk(0, 5, [1, 2**64 - 1], False), ".entries[1]"),
        (wire.LogChunk(0, 5, [1, (2**64 - 1, 3)], True), ".entries[1][0]"),
    ],
)
def test_every_number_of_a_log_chunk_is_range_checked(chunk: wire.LogChunk, where: str) -> None:
    b = batch(0)
    b.log = [chunk]
    assert (bad_number(b) or "").startswith(f"Batch.log[0]{where} = ")
    with pytest.raises(wire.WireError):
        wire.decode(wire.encode(b))
    b.log = [wire.LogChunk(2**40, COUNT_MAX, [2**63 - 1, -(2**63)], False)]
    assert bad_number(b) is None  # the bounds themselves pass


def _v4_recording(path: Path, mutate: Callable[[wire.Batch], None]) -> Path:
    """A rank of wire protocol 4 (format 1), as recording_compat reads it."""
    seg = path / "rank0" / "full-000000.ttrec"
    seg.parent.mkdir(parents=True)
    h = hello()
    h.v = 4
    frames = [rec.frame(wire.encode(h))]
    for k in range(N):
        b = batch(k)
        b.v = 4
        mutate(b)
        frames.append(rec.frame(wire.encode(b)))
    seg.write_bytes(rec.header(protocol=4, version=1, writer="") + b"".join(frames))
    return path


def test_a_rank_whose_log_yields_no_steps_is_said(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def odd(b: wire.Batch) -> None:  # one entry a chunk no replay reads: a time that is text
        b.log[0].entries[0] = ("t",)

    path = _v4_recording(tmp_path / "v4", odd)
    assert main(["report", str(path), "--history"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["steps"] == 0
    assert "yields no steps" in err and f"{N} log chunk(s) could not be read" in err, err
    # in a job: the rank's line in the job's notes
    job = _job(tmp_path / "job")
    shutil.rmtree(job / "rank1")
    shutil.copytree(path / "rank0", job / "rank1")
    played = JobPlayback({0: job / "rank0", 1: job / "rank1"})
    assert any(n.startswith("rank 1: ") and "yields no steps" in n for n in played.job_until().notes)
    clean = _v4_recording(tmp_path / "clean", lambda b: None)
    pb, ranks = load(clean)
    assert pb.no_steps() is None and pb.steps_total == N * 10


def test_ranks_of_two_jobs_are_said(tmp_path: Path) -> None:
    path = tmp_path / "job"
    _rank_with(path, 0, lambda b: None, job_id="job-a")
    _rank_with(path, 1, lambda b: None, job_id="job-b")
    played = JobPlayback({0: path / "rank0", 1: path / "rank1"})
    assert any("ranks of 2 jobs" in w for w in played.warnings)
    assert any("ranks of 2 jobs" in n for n in played.job_until().notes)


def test_one_rank_recorded_twice_is_said(tmp_path: Path) -> None:
    path = _job(tmp_path / "job")
    shutil.copytree(path / "rank1", path / "rank01")  # a second name of rank 1
    _rank_with(path, 2, lambda b: None)
    for seg in (path / "rank2").iterdir():  # rank2/ holds rank 0's recording
        seg.unlink()
    w = store.RecordingWriter(path, 2)
    w.write(hello(rank=0))
    for k in range(N):
        w.write(batch(k, rank=0))
    w.close()
    pb, ranks = load(path)
    assert sorted(ranks) == [0, 1, 2] and ranks[1].name == "rank1"
    played = JobPlayback(ranks)
    assert any("rank 1 recorded twice (rank1/ and rank01/)" in w for w in played.warnings)
    assert any("rank 0 recorded twice (rank0/, rank2/)" in w for w in played.warnings)


def test_ranks_recorded_apart_in_time_are_said(tmp_path: Path) -> None:
    path = tmp_path / "job"
    write(path, N, rank=0)

    def later(b: wire.Batch) -> None:
        b.time += 3600.0

    _rank_with(path, 1, later)
    played = JobPlayback({0: path / "rank0", 1: path / "rank1"})
    assert any("rank 1 was recorded" in w and "two runs" in w for w in played.warnings)
    assert not any("was recorded" in w for w in JobPlayback(load(_job(tmp_path / "ok"))[1]).warnings)
