"""The number check is the live path's too (issue 26): a same-user process publishing batches with
NaN or infinite figures gets them counted as bad frames by the monitor's client, with the field
named, and the good batches around them still arrive."""

from __future__ import annotations

import time

import msgspec
import zmq

from tests.agent_util import free_port_pair
from torchtop.contract import wire
from torchtop.monitor.link.client import AgentClient
from torchtop.monitor.link.targets import Endpoint

V = wire.PROTOCOL_VERSION
NAN, INF = float("nan"), float("inf")


def test_nan_batches_on_the_stream_are_counted_not_applied() -> None:
    port = free_port_pair()
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://127.0.0.1:{port + 1}")
    c = AgentClient(Endpoint.tcp("127.0.0.1", port))

    def batch(seq: int, **kw: object) -> wire.Batch:
        return wire.Batch(v=V, run_id="fake", seq=seq, time=1.8e9 + seq, **kw)  # type: ignore[arg-type]

    try:
        deadline = time.monotonic() + 10
        while not c.recv_batches(0.1):  # until the subscription is live
            assert time.monotonic() < deadline
            pub.send(wire.encode(batch(0)))
        c.recv_batches(0.2)
        bad_before = c.bad_frames
        hostile = [
            batch(9, wall_offset=NAN),
            msgspec.structs.replace(batch(9), time=INF),
            batch(9, telemetry=wire.Telemetry(time=1.8e9, memory=[], host=None, unavailable={}, steps=None)),
        ]
        hostile[2].telemetry.time = NAN  # type: ignore[union-attr]
        for k in range(1, 4):
            for msg in hostile:
                pub.send(wire.encode(msg))
            pub.send(wire.encode(batch(k)))
        got: list[wire.Batch] = []
        while len(got) < 3 and time.monotonic() < deadline:
            got.extend(r.batch for r in c.recv_batches(0.5))
        assert [b.seq for b in got] == [1, 2, 3]
        assert c.bad_frames - bad_before == 3 * len(hostile)
        assert "Batch.telemetry.time = nan" in c.last_error and "must be finite" in c.last_error, c.last_error
    finally:
        c.close()
