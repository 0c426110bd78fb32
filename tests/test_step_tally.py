"""Every step counted: the agent's whole-run tally (agent/loop/tally.py), the monitor's
(monitor/model/tally.py) and the windows RunState summarises from them. Pure: no sockets."""

from __future__ import annotations

import pytest

from torchtop.agent.loop import tally as agent_tally
from torchtop.agent.loop.tally import StepCounter, last_step_end
from torchtop.contract import logcodes, wire
from torchtop.monitor.diagnosis.report import build_report
from torchtop.monitor.model import state as state_mod
from torchtop.monitor.model.state import RunState
from torchtop.monitor.model.steps import StepRecord
from torchtop.monitor.model.tally import RunTally, quantile_ms

MS = 1_000_000
PHASES = dict.fromkeys(logcodes.PHASES, 0)


def pairs_chunk(seq: int, steps_before: int, ends: list[int], filler: int = 3) -> wire.LogChunk:
    """A chunk of (time, code) pairs: `filler` phase pairs before each step end at `ends` (ns)."""
    items: list = []
    for t in ends:
        for k in range(filler):
            items += [t - (filler - k) * 1000, logcodes.FORWARD]
        items += [t, logcodes.UNTIMED_END]
    items += [ends[-1] + 500, logcodes.DATA] if ends else [seq * 10**9 + 1, logcodes.DATA]
    return wire.LogChunk(seq, steps_before + len(ends), items, True)


def test_last_step_end_reads_back_and_falls_back_to_c_speed(monkeypatch: pytest.MonkeyPatch) -> None:
    chunk = pairs_chunk(0, 0, [5 * MS, 7 * MS])
    assert last_step_end(chunk) == 7 * MS
    tail = [8 * MS + k for k in range(500)]  # a step end followed by many more entries
    chunk.entries += [x for t in tail for x in (t, (logcodes.MARK, "loss", 1.0))]
    assert last_step_end(chunk) == 7 * MS  # found past SCAN_ITEMS, by list.index
    monkeypatch.setattr(agent_tally, "SCAN_ITEMS", 10_000)
    assert last_step_end(chunk) == 7 * MS  # the same read back in Python
    assert last_step_end(wire.LogChunk(0, 0, [1, logcodes.DATA, 2, logcodes.FORWARD], True)) is None
    entries = [5 << logcodes.SHIFT | logcodes.STEP_END, (6 << logcodes.SHIFT | logcodes.MARK, "x", 1.0)]
    assert last_step_end(wire.LogChunk(0, 1, entries, False)) == 5


def test_agent_counter_keeps_a_point_a_width_and_coarsens_past_its_limit() -> None:
    counter = StepCounter(limit=8, width_ns=10 * MS)
    steps = 0
    for seq in range(200):  # 200 ticks of 1 ms steps, 5 a tick
        ends = [seq * 5 * MS + k * MS for k in range(1, 6)]
        counter.keep(pairs_chunk(seq, steps, ends))
        steps += 5
    tally = counter.tally()
    assert tally is not None and tally.start == 1 * MS - 3000
    assert tally.counts[-1] == 1000 and tally.ends[-1] == 199 * 5 * MS + 5 * MS  # the newest, exact
    assert len(tally.ends) <= 9 and tally.width_ns > 10 * MS
    assert tally.counts == sorted(tally.counts) and tally.ends == sorted(tally.ends)
    gaps = [b - a for a, b in zip(tally.ends[:-2], tally.ends[1:-1])]
    assert min(gaps) >= tally.width_ns
    counter.keep(pairs_chunk(200, 1000, []))  # a tick without a step end adds nothing
    tally = counter.tally()
    assert tally is not None and tally.counts[-1] == 1000


def test_the_run_starts_at_its_first_step_not_at_copies_logged_before_the_loop() -> None:
    """A model moved to the GPU before the loop logs its copies, the first holding CUDA's set-up
    (seconds on a GPU): `covered_s` counted from there read 26.7 s of a 22.4 s loop (issue 26)."""
    copy = (logcodes.H2D_COPY, 4_000 * MS, 4096, False, None)
    counter = StepCounter()
    counter.keep(wire.LogChunk(0, 0, [1 * MS, copy, 2 * MS, copy], True))  # only the model's copies
    assert counter.tally() is None
    counter.keep(pairs_chunk(1, 0, [9_000 * MS, 9_010 * MS]))
    tally = counter.tally()
    assert tally is not None and tally.start == 9_000 * MS - 3000  # the first forward's entry
    packed = StepCounter()  # a CUDA run's chunk, packed: a copy, a mark, then the loop
    entries = [
        (1 * MS << logcodes.SHIFT | logcodes.H2D_COPY, 4_000 * MS, 4096, False, None),
        (2 * MS << logcodes.SHIFT | logcodes.MARK, "lr", 0.1),
        5_000 * MS << logcodes.SHIFT | logcodes.FORWARD_START,
        5_004 * MS << logcodes.SHIFT | logcodes.STEP_END,
    ]
    packed.keep(wire.LogChunk(0, 1, entries, False))
    assert (t := packed.tally()) is not None and t.start == 5_000 * MS


def rec(i: int, t0: float, wall_ms: float = 1.0, kind: str = "train") -> StepRecord:
    return StepRecord(i, t0, int(wall_ms * MS), dict(PHASES), kind)  # type: ignore[arg-type]


def run(n: int, start: float = 100.0, wall_ms: float = 1.0, first: int = 0) -> list[StepRecord]:
    return [rec(first + k, start + k * wall_ms / 1000, wall_ms) for k in range(n)]


def test_monitor_tally_counts_steps_never_seen_between_those_seen() -> None:
    tally = RunTally()
    steps = run(5000)
    tally.add(steps[:1000])
    tally.add(steps[3000:])  # 2000 lost with a batch
    assert tally.n == 5000
    span = tally.span(float("-inf"))
    assert span.steps == 5000 and span.seen == 3000
    assert span.wall_ns == pytest.approx(5000 * MS, rel=1e-6)
    assert tally.ended_by(100.0 + 0.5005) == 500  # exact where steps were seen one by one
    assert 1900 <= tally.ended_by(100.0 + 2.0) <= 2100  # spread evenly where they were not
    assert quantile_ms(span.hist, 0.5) == pytest.approx(1.0, rel=0.03)
    tally.add(steps[:10])  # counted already
    assert tally.n == 5000 and tally.span(float("-inf")).steps == 5000


def test_agent_tally_covers_the_run_before_the_first_step_seen() -> None:
    offset = 1000.0  # wall clock = perf_counter + offset
    ends = [int((k + 1) * 1e9) for k in range(10)]  # 1,000 steps a second for 10 s
    tally = wire.StepTally(0, ends, [(k + 1) * 1000 for k in range(10)], 10**9)
    seen = run(500, start=offset + 9.5, first=9500)  # the snapshot's steps: the last half second
    state = RunState(agent_time=offset + 10.0)
    state.apply_snapshot(seen, 3, tally, offset)
    summary = state.summary(float("inf"))
    assert summary.steps == 10_000 and len(summary.in_full) == 500 and summary.thinned
    assert summary.covered_s == pytest.approx(10.0, abs=1e-6)
    assert summary.stats["mean_ms"] == pytest.approx(1.0, rel=1e-3)
    assert summary.stats["steps_per_s"] == pytest.approx(1000, rel=1e-3)
    last3 = state.summary(3.0)
    assert 2950 <= last3.steps <= 3050 and len(last3.in_full) == 500
    report = build_report(state, 1.0, window=float("inf"))
    assert (report["steps"], report["steps_in_full"], report["thinned"]) == (10_000, 500, True)
    assert report["covered_s"] == pytest.approx(10.0)


def test_a_window_longer_than_the_kept_steps_counts_them_all(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(state_mod, "HISTORY", 2000)
    state = RunState()
    steps = [rec(k, 100.0 + k * 0.001, 1.0 + (k * 37 % 1000) / 1000) for k in range(6000)]
    batch = wire.Batch(v=wire.PROTOCOL_VERSION, run_id="r", seq=0, time=100.0 + 6000 * 0.001 + 0.5)
    state.apply_batch(batch, steps, 0.0)
    assert len(state.steps) == 2000
    summary = state.summary(20.0)
    assert summary.steps == 6000 and len(summary.in_full) == 2000 and summary.thinned
    walls = sorted(s.wall_ns / MS for s in steps)
    assert summary.stats["median_ms"] == pytest.approx(walls[3000], rel=0.025)  # binned: 4.4% wide
    assert summary.stats["p90_ms"] == pytest.approx(walls[5400], rel=0.025)
    assert summary.stats["mean_ms"] == pytest.approx(sum(walls) / 6000, rel=1e-6)
    short = state.summary(1.0)  # held whole: exact, not thinned
    assert not short.thinned and short.steps == len(short.in_full) == len(state.window(1.0))


def test_eval_steps_are_not_counted_as_training_steps() -> None:
    state = RunState(agent_time=200.0)
    steps = run(100, start=100.0) + [rec(100 + k, 100.1 + k * 0.001, kind="eval") for k in range(20)]
    steps += run(100, start=100.2, first=120)
    state.apply_batch(wire.Batch(v=wire.PROTOCOL_VERSION, run_id="r", seq=0, time=100.31), steps, 0.0)
    summary = state.summary(10.0)
    assert summary.steps == 200 and len(summary.evals) == 20 and not summary.thinned


def test_an_eval_only_window_counts_no_training_step() -> None:
    """An eval loop's passes, some never seen whole (numbered but not sent: its untimed stretches):
    a report read `"steps": 65` of training with 0 ms step times; the unseen ones are its passes."""
    state = RunState(agent_time=110.0)
    passes = [rec(k * 3, 100.0 + k * 0.03, kind="eval") for k in range(300)]  # 2 in 3 unseen
    state.apply_batch(wire.Batch(v=wire.PROTOCOL_VERSION, run_id="r", seq=0, time=109.0), passes, 0.0)
    summary = state.summary(10.0)
    assert summary.steps == 0 and not summary.in_full and len(summary.evals) > 200
    assert summary.stats["steps_per_s"] == 0.0
