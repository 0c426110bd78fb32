"""Relayed ranks in the job model: a relay's summaries give a rank the same figures as its steps,
coverage counts who reports and names silent nodes and relays that never answered, a relay gone
quiet makes its ranks "not reporting", another job's relay is never mixed in, and a straggler is
chronic or one-off."""

from __future__ import annotations

import time

import msgspec
import pytest

from tests.rank_util import JOB, T0, hello, rank_steps
from torchtop.contract import logcodes as lc
from torchtop.contract import wire
from torchtop.monitor.diagnosis.job_diagnosis import build_job_report
from torchtop.monitor.diagnosis.persistence import persistence
from torchtop.monitor.model.job_state import JobState
from torchtop.monitor.model.rank_stats import RankStats, slots
from torchtop.monitor.model.ranks_view import ranks_view
from torchtop.monitor.model.relayed import coverage, coverage_line, member_key
from torchtop.monitor.relay.summary import RankSummarizer


def _summary(node: str, seq: int, ranks: list[wire.RankSummary], job_id: str = JOB) -> wire.NodeSummary:
    last = max(
        (b.t + 1 for rs in ranks for b in rs.buckets), default=T0
    )  # the relay's clock: its last second
    s = wire.NodeSummary(v=wire.PROTOCOL_VERSION, job_id=job_id, node=node, seq=seq, time=last, ranks=ranks)
    got = wire.decode(wire.encode(s))  # through the wire, as the monitor gets it
    assert isinstance(got, wire.NodeSummary)
    return got


def _relayed(summarizer: RankSummarizer, steps: list, chunk: int = 20) -> list[wire.RankSummary]:
    """The summaries a relay sends while `steps` arrive `chunk` at a time."""
    out = []
    for k in range(0, len(steps), chunk):
        summarizer.stats.add(steps[k : k + chunk])
        summarizer.last_batch = 0.0
        out.append(summarizer.summary(0.1))
    return out


def test_put_replaces_the_open_second_and_rolls_the_closed_one() -> None:
    direct, relayed = RankStats(), RankStats()
    steps = rank_steps(0, n=300, step_ms=50.0)  # 15 s of steps
    s = RankSummarizer(0)
    for k in range(0, len(steps), 7):  # summaries cut mid-second: the open second is sent again
        direct.add(steps[k : k + 7])
        s.stats.add(steps[k : k + 7])
        for b in s.summary(0.0).buckets:
            relayed.put(int(b.t), slots(b))
    assert relayed.window(10) == direct.window(10)
    assert relayed.window(10).steps > 150
    assert [b.v for b in relayed.levels[1]] == [b.v for b in direct.levels[1]]


def test_relayed_ranks_read_as_their_steps_would() -> None:
    direct = JobState()
    relayed = JobState()
    per_rank = {r: rank_steps(r, n=200, data=30.0 if r == 3 else 1.0) for r in range(4)}
    for r, steps in per_rank.items():
        direct.apply_hello(f"r{r}", hello(r))
        direct.apply_batch(
            f"r{r}", wire.Batch(v=wire.PROTOCOL_VERSION, run_id=f"run{r}", seq=0, time=T0), steps, 0.0
        )
    sums = {}
    for r, steps in per_rank.items():
        s = RankSummarizer(r)
        s.set_hello(hello(r))
        sums[r] = _relayed(s, steps)
    from torchtop.monitor.model.relayed import apply_summary

    for k in range(len(sums[0])):
        node_a = [sums[r][k] for r in (0, 1)]
        node_b = [sums[r][k] for r in (2, 3)]
        apply_summary(relayed, "relay-a", _summary("node-a", k + 1, node_a), now=100.0)
        apply_summary(relayed, "relay-b", _summary("node-b", k + 1, node_b), now=100.0)
    assert relayed.job_id == JOB
    assert [m.rank for m in relayed.ranked()] == [0, 1, 2, 3]
    assert relayed.member(member_key("relay-b", 3)).node == "node-b"
    want = ranks_view(direct, 10, None, 0.0)
    got = ranks_view(relayed, 10, None, 100.0)
    assert [r.figures for r in got.rows] == [r.figures for r in want.rows]
    assert got.slowest[0] == 3
    report = build_job_report(relayed, 10, "x", 10, 100.5)
    assert report["straggler"]["rank"] == 3
    assert report["coverage"]["line"] == "4 of 4 ranks reporting"
    assert all(e["via"] == "relay" and e["steps"] > 150 for e in report["ranks"])


def _job_with_relays(nodes: int, per_node: int, now: float) -> JobState:
    from torchtop.monitor.model.relayed import apply_summary

    job = JobState()
    world = nodes * per_node
    for n in range(nodes):
        ranks = []
        for k in range(per_node):
            r = n * per_node + k
            rs = wire.RankSummary(
                rank=r, run_id=f"run{r}", age=0.2, hello=hello(r, world=world, host=f"n{n}")
            )
            ranks.append(rs)
        apply_summary(job, f"relay{n}", _summary(f"node {n}", 1, ranks), now)
    return job


def test_coverage_names_the_silent_node_and_its_ranks_are_not_reporting() -> None:
    job = _job_with_relays(4, 8, now=10.0)
    from torchtop.monitor.model.relayed import apply_summary

    for n in (0, 1, 3):  # node 2's relay goes quiet at t=10
        ranks = [wire.RankSummary(rank=n * 8 + k, run_id=f"run{n * 8 + k}", age=0.1) for k in range(8)]
        apply_summary(job, f"relay{n}", _summary(f"node {n}", 2, ranks), now=50.0)
    c = coverage(job, now=50.0)
    assert (c.reporting, c.expected) == (24, 32)
    assert coverage_line(c) == "24 of 32 ranks reporting; node 2 silent 40 s"
    view = ranks_view(job, 10, None, 50.0)
    assert {r.status for r in view.rows if r.node == "node 2"} == {"not reporting"}
    assert {r.status for r in view.rows if r.node != "node 2"} == {"connected"}


def test_a_relay_quiet_longer_than_its_ranks_were_makes_them_not_reporting_not_stale() -> None:
    job = _job_with_relays(1, 2, now=10.0)  # the relay's last word at t=10: its ranks' batches 0.2 s old
    # at 12.9 their figures are 3.1 s old (stale), 2.9 s of it the relay's quiet, short of its silence
    assert {r.status for r in ranks_view(job, 10, None, 12.9).rows} == {"not reporting"}
    assert {r.status for r in ranks_view(job, 10, None, 12.7).rows} == {"connected"}
    job = _job_with_relays(1, 2, now=10.0)
    for m in job.ranked():  # a rank silent 2.9 s by the relay's word, the relay quiet 0.2 s: its own
        m.state.last_batch_at = 7.1
    assert {r.status for r in ranks_view(job, 10, None, 10.2).rows} == {"stale (3s)"}


def test_a_rank_the_world_size_counts_but_never_seen_is_not_reporting() -> None:
    job = _job_with_relays(2, 4, now=1.0)
    for m in job.ranked():  # a job of 10 ranks: 2 never started
        m.state.hello = msgspec.structs.replace(m.state.hello, world_size=10)  # type: ignore[arg-type]
    assert coverage_line(coverage(job, 1.5)) == "8 of 10 ranks reporting"


def test_a_relay_that_never_answers_is_named_in_the_line_and_the_report(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Node 1's relay (reached over ssh, its label the tunnel's) never sends a summary: the link
    says it silent, and the coverage names it, never only counts its node's ranks as missing."""
    from torchtop.monitor.link.job_link import Event, apply_events
    from torchtop.monitor.link.relay_link import RelayReader
    from torchtop.monitor.link.targets import Endpoint
    from torchtop.monitor.model.relayed import apply_summary

    job = _job_with_relays(1, 8, now=10.0)
    for m in job.ranked():  # a job of 2 nodes of 8: node 1's ranks were never heard of
        m.state.hello = msgspec.structs.replace(m.state.hello, world_size=16)  # type: ignore[arg-type]
    label = "ssh://node1/4711 (pid 4711, its sockets via /tmp/t)"  # as ssh.tunnel names it
    nobody = Endpoint(f"ipc://{tmp_path}/r.req", f"ipc://{tmp_path}/r.pub", 4711, label)
    reader = RelayReader([nobody])
    try:
        events = reader.read(time.monotonic() + 10.0, Event)  # its silence, past SILENT_AFTER_S
    finally:
        reader.close()
    assert [e.kind for e in events] == ["relay-silent"]
    apply_events(job, events, 10.5)
    c = coverage(job, 10.5)
    assert (c.reporting, c.expected) == (8, 16)
    line = coverage_line(c)
    assert line == "8 of 16 ranks reporting; ssh://node1/4711 never answered", line
    report = build_job_report(job, 10, "x", 10, 10.5)
    assert report["coverage"]["line"] == line
    (unreached,) = report["coverage"]["unreached"]
    assert unreached.startswith("ssh://node1/4711: no summary from the relay")
    # it answers at last: named no more, its ranks counted
    ranks = [
        wire.RankSummary(rank=8 + k, run_id=f"run{8 + k}", age=0.1, hello=hello(8 + k, world=16))
        for k in range(8)
    ]
    apply_summary(job, label, _summary("node 1", 1, ranks), 11.0)
    assert coverage_line(coverage(job, 11.0)) == "16 of 16 ranks reporting"


def test_another_jobs_relay_is_never_mixed_in() -> None:
    from torchtop.monitor.model.relayed import apply_summary

    job = _job_with_relays(1, 2, now=1.0)
    other = [wire.RankSummary(rank=0, run_id="x", hello=hello(0, job_id="other@n:1"))]
    apply_summary(job, "relay-x", _summary("node x", 1, other, job_id="other@n:1"), 1.0)
    assert len(job.ranked()) == 2
    assert any("serves job other@n:1" in n for n in job.notes)


@pytest.mark.parametrize("slow_spans, kind", [(range(0, 7), "chronic"), (range(5, 6), "one-off")])
def test_a_straggler_is_chronic_or_one_off(slow_spans: range, kind: str) -> None:
    job = JobState()
    for r in range(4):
        job.apply_hello(f"r{r}", hello(r))
        steps = []
        for span in range(7):  # 7 spans of 10 s, 20 steps of 0.5 s each
            data = 30.0 if r == 2 and span in slow_spans else 1.0
            steps += rank_steps(r, n=20, step_ms=500.0, data=data, first=span * 20)
        job.apply_batch(
            f"r{r}", wire.Batch(v=wire.PROTOCOL_VERSION, run_id=f"run{r}", seq=0, time=T0), steps, 0.0
        )
    p = persistence(job, 2)
    assert p.kind == kind, p
    assert p.spans == 6
    report = build_job_report(job, 10, "x", 10, 0.0)
    if kind == "chronic":  # (the one-off has left the window: no straggler now)
        assert report["straggler"]["persistence"] == "chronic"


def test_summary_buckets_have_the_slots_the_monitor_reads() -> None:
    from torchtop.contract.relay import SECOND_FIELDS
    from torchtop.monitor.model.rank_stats import DEVICE_KEYS, SIZE

    assert len(SECOND_FIELDS) == SIZE + 1 == 1 + 4 + len(lc.PHASES) + 1 + 6 + 4  # + the work slots
    slot_phases = [p for p in lc.PHASES if p != "checkpoint"]  # appended last: relay.Second is append-only
    named = ["t", "steps", "wall_ns", "timed", "timed_wall_ns", *(f"{p}_ns" for p in slot_phases), "sampled"]
    named += [f"dev_{k}_ms" for k in DEVICE_KEYS] + ["worked", "samples", "tokens", "seq", "checkpoint_ns"]
    assert list(SECOND_FIELDS) == named  # the contract's names in rank_stats' slot order


def test_the_export_carries_each_ranks_series_and_the_jobs_verdict() -> None:
    from torchtop.monitor.export.figures import METRICS
    from torchtop.monitor.export.job_figures import RANK_SERIES, job_samples
    from torchtop.monitor.model.relayed import apply_summary

    job = JobState()
    for n in range(2):
        ranks = []
        for k in range(4):
            r = n * 4 + k
            s = RankSummarizer(r)
            s.set_hello(hello(r, world=8, host=f"h{n}"))
            ranks.append(_relayed(s, rank_steps(r, n=200, data=30.0 if r == 6 else 1.0), chunk=200)[0])
        apply_summary(job, f"relay{n}", _summary(f"node{n}", 1, ranks), now=5.0)
    got = job_samples(job, 10, "llm", now=5.0)
    assert all(s.name in METRICS for s in got)
    by = {(s.name, dict(s.labels).get("rank"), dict(s.labels).get("phase")): s for s in got}
    assert len([s for s in got if s.name.startswith("torchtop_rank_")]) == 8 * RANK_SERIES
    assert by[("torchtop_rank_phase_seconds", "6", "data")].value == pytest.approx(0.030)
    assert dict(by[("torchtop_rank_step_seconds", "6", None)].labels) == {
        "job": "llm",
        "node": "node1",
        "rank": "6",
    }
    assert by[("torchtop_job_straggler_rank", None, None)].value == 6
    assert by[("torchtop_job_straggler_wait_share_ratio", None, None)].value > 0.4
    assert by[("torchtop_job_ranks_reporting", None, None)].value == 8
    assert by[("torchtop_job_ranks_expected", None, None)].value == 8
    top = job_samples(job, 10, "llm", now=5.0, top=2)
    assert {dict(s.labels)["rank"] for s in top if s.name == "torchtop_rank_step_seconds"} <= {
        "6",
        *map(str, range(8)),
    }
    assert len({dict(s.labels)["rank"] for s in top if s.name == "torchtop_rank_step_seconds"}) == 2
    assert "6" in {dict(s.labels)["rank"] for s in top if s.name == "torchtop_rank_step_seconds"}
