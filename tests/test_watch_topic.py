"""A node's relay subscribes to a rank's stream without watching it: batches flow at the quiet
rate and the why probes (stack samples, sync windows, fast telemetry) rest; a monitor (the
client) subscribes to wire.WATCH_TOPIC as well, and they run while it watches. Without this,
every rank of a multi-rank job would pay the watched cost from the moment its relay started."""

from __future__ import annotations

import time

import pytest
import zmq

from tests.agent_util import client_for
from torchtop.contract import wire

pytestmark = pytest.mark.slow  # a real agent and training loop for a few seconds


def _relay_like(address: str) -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")  # everything, as monitor/relay/node.py does
    sub.connect(address)
    return sub


def _train_for(seconds: float, torch, model, opt) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        loss = model(torch.randn(8, 32)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.002)


def test_a_relay_is_not_a_watcher_and_a_monitor_is(agent) -> None:  # type: ignore[no-untyped-def]
    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(32, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sub = _relay_like(agent.sockets.pub_address)
    try:
        _train_for(2.0, torch, model, opt)
        got = 0
        while sub.poll(0):
            got += isinstance(wire.decode(sub.recv()), wire.Batch)
        assert got > 0, "a relay-like subscriber received no batch"
        assert agent.loop.subscribed and not agent.loop.watched
        assert agent.loop.tick_period() >= 0.5  # the quiet rate: a relay's summaries are 1-2 Hz
        assert agent.why is None or not agent.why.sampler.attended, "the stack sampler runs for a relay"

        client = client_for(agent)  # a monitor: subscribes to WATCH_TOPIC too
        try:
            client.hello(timeout=5.0)
            deadline = time.monotonic() + 10
            while not agent.loop.watched and time.monotonic() < deadline:
                _train_for(0.2, torch, model, opt)
            assert agent.loop.watched
            _train_for(0.5, torch, model, opt)
            assert agent.why is None or agent.why.sampler.attended
        finally:
            client.close()
        deadline = time.monotonic() + 10
        while agent.loop.watched and time.monotonic() < deadline:
            _train_for(0.2, torch, model, opt)
        assert not agent.loop.watched and agent.loop.subscribed  # the monitor left; the relay stays
    finally:
        sub.close(linger=0)
