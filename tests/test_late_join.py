"""Late join and history: a monitor that attaches mid-run gets what the agent retained, then the
live stream, stitched by sequence number, with no gap; several monitors are independent."""

from __future__ import annotations

import time

import pytest
import torch

import torchtop.agent as ta
from tests.agent_util import client_for, snapshot_steps
from torchtop.agent.loop import history
from torchtop.agent.loop import loop as agent_loop
from torchtop.contract.wire import SNAPSHOT_MAX_STEPS
from torchtop.monitor.diagnosis.report import build_report
from torchtop.monitor.link.client import AgentClient
from torchtop.monitor.model.state import RunState


def _train(n: int) -> None:
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 8)
    for _ in range(n):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()


def _join(agent) -> tuple[RunState, AgentClient]:
    """What the TUI and `report --history` do: subscribe, hello, snapshot, then the stream."""
    client = client_for(agent)
    state = RunState()
    state.apply_hello(client.hello())
    reply, steps = client.snapshot(max_steps=SNAPSHOT_MAX_STEPS)
    assert reply.ok, reply.error
    state.apply_snapshot(steps, reply.seq, reply.tally, reply.wall_offset)
    return state, client


def _drain(state: RunState, client, until: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (not state.steps or state.steps[-1].i < until):
        for got in client.recv_batches(0.2):
            state.apply_batch(got.batch, got.steps, time.monotonic())


@pytest.mark.slow  # among the fast subset's slowest, ~1.6 s here (issue 27: the subset under 60 s)
def test_joining_after_1000_steps_gets_all_of_them_then_the_live_ones() -> None:
    agent = ta.start()
    assert agent is not None
    _train(1000)
    snapshot_steps(agent, 1000)  # published: the agent's history holds them all (a tick drains the log)
    first, c1 = _join(agent)
    second, c2 = _join(agent)  # a second monitor, independent of the first
    try:
        assert [s.i for s in first.steps] == list(range(1000))
        _train(200)
        _drain(first, c1, 1199)
        _drain(second, c2, 1199)
        for state in (first, second):
            assert [s.i for s in state.steps] == list(range(1200))  # no gap, no duplicate
            assert state.gaps == 0
    finally:
        c1.close()
        c2.close()


@pytest.mark.slow  # a long real loop
def test_history_is_downsampled_beyond_its_last_entries(monkeypatch) -> None:
    """Beyond HISTORY_ENTRIES the agent keeps one whole step per log chunk (~one per tick),
    numbered as it was, so a late joiner still sees the run from its start."""
    monkeypatch.setattr(history, "HISTORY_ENTRIES", 3000)  # 500 steps of 6 entries
    monkeypatch.setattr(agent_loop, "QUIET_RATE_HZ", 10.0)  # unattended, a tick (a chunk) each 0.1 s
    agent = ta.start(phase_every=1)  # every step timed: 6 entries each
    assert agent is not None
    t0 = time.time()
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 8)
    for _ in range(1500):  # ~3 s: ~30 chunks
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        time.sleep(0.002)
    trained = time.time()  # the run's last step has ended: what follows is this test's own time
    time.sleep(0.4)
    state, client = _join(agent)
    client.close()
    idx = [s.i for s in state.steps]
    assert idx == sorted(set(idx)) and idx[-1] == 1499
    k = len(idx) - 1
    while k > 0 and idx[k - 1] == idx[k] - 1:
        k -= 1
    recent, older = list(state.steps)[k:], list(state.steps)[:k]
    assert 350 <= len(recent) <= 510  # the last HISTORY_ENTRIES: every step
    assert len(older) >= 5 and older[0].i < 300  # thinned ones reaching back to the start
    assert all(b.i - a.i > 1 for a, b in zip(older, older[1:]))
    # about one per tick (0.1 s): the median, as a tick a loaded machine ran late has the next come early
    gaps = sorted(b.t0 - a.t0 for a, b in zip(older, older[1:]))
    assert gaps[len(gaps) // 2] >= 0.05, gaps
    assert all(s.phases["forward"] > 0 and s.phases["backward"] > 0 for s in older)  # whole steps
    report = build_report(state, 1.0, window=float("inf"))
    assert report["history"] and report["thinned"]
    assert report["steps"] == 1500 and report["steps_in_full"] == len(idx)  # every step counted
    assert trained - t0 - 1.5 <= report["covered_s"] <= trained - t0 + 0.1  # from the start

    # a limit reaching past the full history takes that many thinned steps before it
    client = client_for(agent)
    try:
        client.hello()
        _, steps = client.snapshot(max_steps=len(recent) + 3)
        assert [s.i for s in steps] == [s.i for s in older[-3:]] + [s.i for s in recent]
        _, steps = client.snapshot(max_steps=100)
        assert [s.i for s in steps] == list(range(1400, 1500))
    finally:
        client.close()


@pytest.mark.slow  # among the fast subset's slowest, ~3.5 s here (issue 27: the subset under 60 s)
def test_a_late_monitor_gets_the_agents_per_second_memory_lows() -> None:
    """The leak rule looks back a minute: a monitor that joins (or a 10 s report) gets the lows
    the agent kept, from the `memory` request and with a snapshot."""
    agent = ta.start()
    assert agent is not None
    kept = []
    assert agent.telemetry is not None
    trend = agent.telemetry.trend
    # unwatched, the agent samples memory once a second: three seconds' lows (a loaded machine's
    # sampler may miss a second), and ~3.5 s of training at least
    least, deadline = time.monotonic() + 3.5, time.monotonic() + 60
    while time.monotonic() < least or len(trend.lows()) < 3:
        assert time.monotonic() < deadline, trend.lows()
        _train(20)
        kept.append(torch.ones(256 * 1024))  # 1 MiB a round, kept: RSS climbs
        time.sleep(0.02)
    client = client_for(agent)
    try:
        lows = client.memory()
        assert len(lows) >= 2, lows
        assert all(a.time < b.time for a, b in zip(lows, lows[1:]))
        assert all(m.rss > 10 * 2**20 and m.allocated == 0 for m in lows)
        assert lows[-1].rss > lows[0].rss
        steps = [m.steps for m in lows]  # the step count with each low: the leak rule's x axis
        counts = [c for c in steps if c is not None]
        probe = agent.probe  # (what it counted, should the lows' counts not climb)
        said = (steps, probe.steps, probe.active, probe.failures)
        assert len(counts) == len(steps) and counts == sorted(counts) and counts[-1] > counts[0], said
        reply, _ = client.snapshot(max_steps=10)
        assert reply.ok and [m.time for m in reply.memory][: len(lows)] == [m.time for m in lows]
    finally:
        client.close()


def test_memory_trend_keeps_each_seconds_low() -> None:
    from torchtop.agent.telemetry.memory_trend import MemoryTrend

    trend = MemoryTrend(keep=3)
    for t, rss, alloc in [
        (10.1, 50, 0),
        (10.5, 40, 0),
        (10.9, 45, 0),
        (11.2, 60, 7),
        (11.8, 55, 9),
        (12.0, 1, 1),
    ]:
        trend.add(t, rss, alloc)
    assert [(m.time, m.rss, m.allocated) for m in trend.lows()] == [(10.1, 40, 0), (11.2, 55, 7)]
    for t in range(13, 20):
        trend.add(float(t), 100, 0)
    assert [m.time for m in trend.lows()] == [16.0, 17.0, 18.0]  # bounded: the newest `keep`
