"""The relay summary as a contract (agent/contract/relay.py): an older relay read by this monitor
(its missing figures unknown), a newer one (its extra figures ignored), this relay read by an
older monitor, every figure checked where it arrives (a rogue relay's odd bucket, a rank outside
the job, a clock far off: left out and said once), one rank claimed twice never shown gone, and
the job's phases read alike whether its ranks come through relays or directly."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from tests.rank_util import JOB, T0, hello, rank_steps
from torchtop.contract import wire
from torchtop.contract.relay import SECOND_FIELDS, Second, second_problem
from torchtop.monitor.diagnosis.job_diagnosis import build_job_report, diagnose_job
from torchtop.monitor.model.job_state import JobState
from torchtop.monitor.model.rank_stats import SIZE, WN, RankStats
from torchtop.monitor.model.relayed import apply_summary, member_key
from torchtop.monitor.relay.summary import RankSummarizer

END = T0 + 10  # the relay's clock when it sends: after the ranks' 10 s of steps


def _steps(rank: int, **kw: Any) -> list:
    return rank_steps(rank, n=200, step_ms=50.0, **kw)  # 10 s from T0


def _buckets(rank: int, steps: list) -> list[list[float]]:
    """A rank's seconds as plain lists: how a relay of any version puts them on the wire."""
    s = RankSummarizer(rank)
    s.stats.add(steps)
    return [[float(b.t), *b.v] for b in s.stats.levels[0]]


def _frame(ranks: list[dict], **extra: object) -> wire.NodeSummary:
    """A NodeSummary built by hand as a relay of another version would send it, decoded here."""
    msg = {"type": "summary", "v": wire.PROTOCOL_VERSION, "job_id": JOB, "node": "node1", "seq": 1}
    got = wire.decode(msgspec.msgpack.encode({**msg, "time": END, "ranks": ranks, **extra}))
    assert isinstance(got, wire.NodeSummary)
    return got


def _rank(rank: int, buckets: list[list[float]], **extra: object) -> dict:
    return {
        "rank": rank,
        "run_id": f"run{rank}",
        "age": 0.1,
        "hello": hello(rank),
        "buckets": buckets,
        **extra,
    }


def _direct(steps: list) -> RankStats:
    stats = RankStats()
    stats.add(steps)
    return stats


def test_an_older_relay_without_the_work_figures_reads_them_as_unknown() -> None:
    steps = _steps(0)
    older = [b[: 1 + WN] for b in _buckets(0, steps)]  # [second, 18 sums]: before the work slots
    job = JobState()
    apply_summary(job, "relay", _frame([_rank(0, older)]), now=1.0)
    got = job.member(member_key("relay", 0)).stats.window(10)
    want = _direct(steps).window(10)
    assert got.work is None  # unknown, not 0 samples
    assert (got.steps, got.step_ms, got.phases) == (want.steps, want.step_ms, want.phases)
    assert build_job_report(job, 10, "x", 10, 1.0)["ranks"][0]["steps"] == want.steps


def test_a_newer_relays_extra_figures_are_ignored_and_said() -> None:
    steps = _steps(0, data=20.0)
    newer = [[*b, 7.0, 8.0, 9.0] for b in _buckets(0, steps)]  # 3 figures this monitor does not know
    job = JobState()
    apply_summary(job, "relay", _frame([_rank(0, newer)], summary_v=wire.SUMMARY_VERSION + 1), now=1.0)
    assert job.member(member_key("relay", 0)).stats.window(10) == _direct(steps).window(10)
    report = build_job_report(job, 10, "x", 10, 1.0)  # what report / export / attach --store read
    assert report["ranks"][0]["steps"] == _direct(steps).window(10).steps > 150
    assert any(f"summary version {wire.SUMMARY_VERSION + 1}" in n for n in report["notes"])


class OldRank(msgspec.Struct):  # the monitor before the contract: an unnamed list of numbers
    rank: int
    run_id: str
    buckets: list[list[float]] = []


class OldSummary(msgspec.Struct, tag="summary"):
    v: int
    job_id: str
    node: str
    seq: int
    time: float
    ranks: list[OldRank] = []


def test_this_relay_is_read_by_an_older_monitor() -> None:
    s = RankSummarizer(0)
    s.stats.add(_steps(0))
    rs = s.summary(0.0)
    frame = wire.encode(
        wire.NodeSummary(
            v=wire.PROTOCOL_VERSION,
            job_id=JOB,
            node="n",
            seq=1,
            time=END,
            ranks=[rs],
            summary_v=wire.SUMMARY_VERSION,
        )
    )
    old = msgspec.msgpack.Decoder(OldSummary).decode(frame)
    got = old.ranks[0].buckets
    assert [len(b) for b in got] == [SIZE + 1] * len(got)  # the layout it was built for, to the slot
    assert got == [list(msgspec.structs.astuple(b)) for b in rs.buckets]


@pytest.mark.parametrize(
    "change, why",
    [
        ({"timed": 500.0}, "timed 500 of"),
        ({"data_ns": -1.0}, "below 0"),
        ({"steps": 2.5}, "steps 2.5 of 2.5"),
        ({"t": END + 3600}, "+3600 s from"),
        ({"t": END - 3600}, "-3600 s from"),
    ],
)
def test_an_odd_second_is_left_out_and_said_once(change: dict, why: str) -> None:
    good = _buckets(0, _steps(0))
    odd = msgspec.structs.replace(Second(*good[-1]), **change)
    assert why in (second_problem(odd, END) or "")
    job = JobState()
    ranks = [_rank(0, good), _rank(1, [list(msgspec.structs.astuple(odd))] * 3)]
    apply_summary(job, "relay", _frame(ranks), now=1.0)
    assert job.member(member_key("relay", 1)).stats.window(10).steps == 0
    assert job.member(member_key("relay", 0)).stats.window(10).steps > 150
    said = [n for n in job.notes if "out of range" in n]
    assert len(said) == 1 and why in said[0], job.notes


def test_ranks_outside_the_job_and_a_clock_far_off_are_left_out() -> None:
    good = _buckets(0, _steps(0))
    job = JobState()
    outside = {"rank": 4, "run_id": "x", "buckets": good}  # a world of 4 (its hello says so)
    lying = _rank(2, good, hello=hello(3))  # the hello of another rank
    apply_summary(job, "relay", _frame([_rank(0, good), outside, lying]), now=1.0)
    assert [m.rank for m in job.ranked()] == [0]
    assert member_key("relay", 4) not in job.members
    apply_summary(job, "relay2", _frame([_rank(1, good)]), now=1.0, wall=END + 3600)
    assert [m.rank for m in job.ranked()] == [0]  # a relay an hour ahead would hide every other rank
    assert any("clock is -3600 s" in n for n in job.notes), job.notes


def test_one_rank_claimed_twice_on_a_relay_is_said_and_the_live_one_shown() -> None:
    good = _buckets(1, _steps(1))
    job = JobState()
    real = _rank(1, good)
    rogue = {**_rank(1, []), "run_id": "rogue", "gone": True, "hello": None, "age": 30.0}
    for seq in (1, 2):  # the rogue listed first, then last: the real one stays
        frame = _frame([rogue, real] if seq == 1 else [real, rogue], duplicates=["rank 1: pids 1001, 666"])
        apply_summary(job, "relay", frame, now=1.0)
    m = job.member(member_key("relay", 1))
    assert not m.state.gone and m.hello is not None and m.hello.run_id == "run1"
    assert m.stats.window(10).steps > 150
    assert any("lists rank 1 twice" in n for n in job.notes), job.notes
    assert any("two agents claim rank 1: pids 1001, 666" in n for n in job.notes), job.notes


def test_the_jobs_phases_read_alike_through_relays_and_directly() -> None:
    """Most of the step outside the phases: the aggregate of direct ranks reads outside-phases;
    relays, whose monitor holds no steps, read the same from the ranks' `other` (not the
    collective wait, which is the next largest)."""
    per = {r: _steps(r, data=1, forward=3, backward=5, optimizer=1, comm=10) for r in range(4)}
    direct, relayed = JobState(), JobState()
    for r, steps in per.items():
        direct.apply_hello(f"r{r}", hello(r))
        batch = wire.Batch(v=wire.PROTOCOL_VERSION, run_id=f"run{r}", seq=0, time=T0)
        direct.apply_batch(f"r{r}", batch, steps, 0.0)
    ranks = [_rank(r, _buckets(r, steps)) for r, steps in per.items()]
    apply_summary(relayed, "relay", _frame(ranks), now=1.0)
    a, b = diagnose_job(direct)[0].verdict, diagnose_job(relayed)[0].verdict
    assert (b.kind, b.severity) == (a.kind, a.severity) == ("outside-phases", "critical")
    assert b.share == pytest.approx(a.share, abs=0.02)


def test_the_seconds_fields_are_rank_stats_slots() -> None:
    assert len(SECOND_FIELDS) == SIZE + 1


def test_a_relayed_ranks_telemetry_points_are_capped() -> None:
    """A relay sends each rank's telemetry twice a second: kept to the default 20,000 points a
    rank, a 1,024-rank job view grew by ~2,000 objects a second (gigabytes in hours)."""
    from torchtop.monitor.model.relayed import RELAYED_POINTS
    from torchtop.monitor.model.state import HISTORY

    job = JobState()
    tel = wire.Telemetry(
        time=END, host=wire.HostSample(proc_cpu=50.0, proc_rss=2**30, threads=4, cpu_count=8)
    )
    summary = _frame([_rank(0, _buckets(0, _steps(0)))])
    apply_summary(job, "relay1", summary, 100.0)
    m = job.members[member_key("relay1", 0)]
    for k in range(RELAYED_POINTS + 50):
        s = wire.NodeSummary(
            v=wire.PROTOCOL_VERSION, job_id=JOB, node="node1", seq=2 + k, time=END,
            ranks=[wire.RankSummary(rank=0, run_id="run0", age=0.1, telemetry=tel)],
        )  # fmt: skip
        apply_summary(job, "relay1", s, 100.0 + k / 2)
    assert RELAYED_POINTS < HISTORY and len(m.state.points) == RELAYED_POINTS
    assert m.state.telemetry is tel  # the latest still read
