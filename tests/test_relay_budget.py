"""A flooding peer cannot starve the others (real sockets, real relay): a rogue agent that claims
rank 1 on a relay's node and floods it leaves the relay publishing, both real ranks current, the
duplicate named, and the real rank 1 never shown gone (also once the rogue has gone); a relay
that floods its monitor leaves the other relays read."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from tests.benchmarks.bench_job_monitor import _step, free_pairs
from tests.benchmarks.bench_relays import JOB, _hello, agents_feeder
from tests.rank_util import hello as rank_hello
from torchtop.contract import wire
from torchtop.contract.discovery import AgentInfo
from torchtop.monitor.model.job_state import JobState
from torchtop.monitor.model.relayed import apply_summary, member_key
from torchtop.monitor.relay.node import Relay

pytestmark = pytest.mark.slow
ROGUE_PID = 100_002


def _flood(address: str, frames: list[bytes], ready, stop, hello: wire.Hello | None = None) -> None:
    """Publish `frames` on `address` as fast as the socket takes them (answering hello when an
    agent), until `stop`."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.SNDHWM, 100_000)
    pub.setsockopt(zmq.LINGER, 0)  # stopped: gone at once, nothing left to deliver
    pub.bind(address)
    router = None
    if hello is not None:
        router = ctx.socket(zmq.ROUTER)
        router.bind(address.replace(".pub", ".req"))
    ready.set()
    while not stop.is_set():
        while router is not None and router.poll(0):
            parts = router.recv_multipart()
            req = wire.decode(parts[-1])
            assert isinstance(req, wire.Request)
            reply = wire.Reply(v=wire.PROTOCOL_VERSION, id=req.id, ok=True, hello=hello)
            router.send_multipart([*parts[:-1], wire.encode(reply)])
        try:
            while pub.recv(zmq.NOBLOCK):
                pass
        except zmq.Again:
            pass
        for _ in range(50):
            for f in frames:
                try:
                    pub.send_multipart(f if isinstance(f, list) else [f], zmq.NOBLOCK)
                except zmq.Again:
                    pass
    ctx.destroy(linger=0)


def _rogue_frame() -> bytes:
    raw: list[int | tuple[Any, ...]] = []
    t = 10**9
    for _ in range(200):  # a batch with 200 steps: every frame costs the relay a replay
        raw += _step(t, 1_000_000, True, False)
        t += 1_000_000
    batch = wire.Batch(
        v=wire.PROTOCOL_VERSION, run_id="rogue", seq=0, time=time.time(),
        log=[wire.LogChunk(0, 200, raw, True)], wall_offset=time.time() - 1, rank=1,
    )  # fmt: skip
    return wire.encode(batch)


def test_a_rank_flooding_its_relay_starves_no_other(tmp_path: Path) -> None:
    d = str(tmp_path)
    ready, rogue_ready, sent, stop = mp.Event(), mp.Event(), mp.Value("q", 0), mp.Event()
    feeder = mp.Process(target=agents_feeder, args=(d, 2, 100.0, 60.0, ready, sent), daemon=True)
    h = msgspec.structs.replace(_hello(1, 2, "node0", time.time()), run_id="rogue", pid=ROGUE_PID)
    rogue = mp.Process(target=_flood, args=(f"ipc://{d}/rogue.pub", [_rogue_frame()], rogue_ready, stop, h))
    feeder.start()
    rogue.start()
    assert ready.wait(30) and rogue_ready.wait(30)
    entries = [
        AgentInfo(pid=100_000 + r, rank=r, job_id=JOB, address=f"ipc://{d}/a{r}.req", pub_address=f"ipc://{d}/a{r}.pub")
        for r in range(2)
    ] + [AgentInfo(pid=ROGUE_PID, rank=1, job_id=JOB, address=f"ipc://{d}/rogue.req", pub_address=f"ipc://{d}/rogue.pub")]  # fmt: skip
    relay = Relay(JOB, "node0", tmp_path, source=lambda: entries)
    relay_stop = threading.Event()
    thread = threading.Thread(target=relay.run, args=(relay_stop, 3600.0), daemon=True)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"S")
    sub.connect(relay.pub_address)
    thread.start()
    job = JobState()
    got: list[wire.NodeSummary] = []

    def take(seconds: float) -> list[wire.NodeSummary]:
        out = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if sub.poll(100):
                msg = wire.decode(sub.recv_multipart()[1])
                assert isinstance(msg, wire.NodeSummary)
                apply_summary(job, "relay", msg, time.monotonic())
                out.append(msg)
        return out

    try:
        take(4.0)  # warm: the rogue has been found and floods
        t0 = time.monotonic()
        got = take(6.0)
        span = time.monotonic() - t0
        assert len(got) >= 0.5 * span / 0.5, f"{len(got)} summaries in {span:.1f} s: the relay starved"
        last = got[-1]
        real = {rs.rank: rs for rs in last.ranks if rs.run_id != "rogue"}
        assert sorted(real) == [0, 1] and all(0 <= rs.age < 2.0 for rs in real.values()), last.ranks
        assert any(d.startswith("rank 1: pids") and str(ROGUE_PID) in d for s in got for d in s.duplicates)
        stop.set()  # the rogue goes: the relay marks it gone, never the real rank 1
        rogue.join(10)
        # its backlog read, 3 s silent, its hello unanswered 3 s: read until then (a loaded machine
        # takes longer), the real rank 1 applied from every summary meanwhile
        after: list[wire.NodeSummary] = []
        deadline = time.monotonic() + 60
        while not any(rs.run_id == "rogue" and rs.gone for s in after for rs in s.ranks):
            assert time.monotonic() < deadline, "the rogue not seen gone"
            after += take(1.0)
        take(5.0)  # and a while after it: the real rank 1 still not gone
    finally:
        stop.set()
        relay_stop.set()
        thread.join(5)
        sub.close(linger=0)
        ctx.term()
        relay.close()
        feeder.terminate()
        rogue.terminate()
    m = job.member(member_key("relay", 1))
    assert m.hello is not None and m.hello.run_id == "run00001" and not m.state.gone
    assert any("two agents claim rank 1" in n for n in job.notes), job.notes


def _node_summary(node: str, seq: int) -> bytes:
    ranks = [
        wire.RankSummary(rank=r, run_id=f"run{r}", age=0.1, hello=rank_hello(r, world=16)) for r in range(8)
    ]
    msg = wire.NodeSummary(
        v=wire.PROTOCOL_VERSION, job_id=JOB, node=node, seq=seq, time=time.time(), ranks=ranks
    )
    return wire.encode(msg)


def _steady(address: str, ready, stop, sent) -> None:
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.bind(address)
    ready.set()
    seq = 0
    while not stop.is_set():
        try:
            while pub.recv(zmq.NOBLOCK):
                pass
        except zmq.Again:
            pass
        seq += 1
        pub.send_multipart([b"S", _node_summary("steady", seq)])
        with sent.get_lock():
            sent.value += 1
        time.sleep(0.5)


def test_a_relay_flooding_its_monitor_starves_no_other_relay() -> None:
    from torchtop.monitor.link.job_link import Event
    from torchtop.monitor.link.relay_link import RelayReader
    from torchtop.monitor.link.targets import Endpoint

    flood_port, steady_port = free_pairs(2)
    r1, r2, stop, sent = mp.Event(), mp.Event(), mp.Event(), mp.Value("q", 0)
    frame = [b"S", _node_summary("flood", 1)]
    flood = mp.Process(target=_flood, args=(f"tcp://127.0.0.1:{flood_port}", [frame], r1, stop), daemon=True)
    steady = mp.Process(target=_steady, args=(f"tcp://127.0.0.1:{steady_port}", r2, stop, sent), daemon=True)
    flood.start()
    steady.start()
    assert r1.wait(30) and r2.wait(30)
    reader = RelayReader(
        [
            Endpoint(f"tcp://127.0.0.1:{p + 1}", f"tcp://127.0.0.1:{p}", None, name)
            for name, p in (("flood", flood_port), ("steady", steady_port))
        ]
    )
    counts = {"steady": 0, "flood": 0}
    sent_at: list[int] = []

    def loop() -> None:
        end = time.monotonic() + 8.0
        while time.monotonic() < end:
            for ev in reader.read(time.monotonic(), Event):
                if ev.kind == "summary":
                    counts[ev.summary.node] += 1
                    if ev.summary.node == "steady":
                        sent_at.append(sent.value)
            time.sleep(0.05)

    try:
        # both connected and subscribed (a summary of each read), then counted: what the steady
        # relay sends before its subscription is through is lost to any reader, on a loaded
        # machine for longer than a fixed second
        deadline = time.monotonic() + 60
        first: set[str] = set()
        while first != {"steady", "flood"}:
            assert time.monotonic() < deadline, f"only {first} read after 60 s"
            first |= {ev.summary.node for ev in reader.read(time.monotonic(), Event) if ev.kind == "summary"}
            time.sleep(0.05)
        start = sent.value
        t = threading.Thread(target=loop, daemon=True)
        t.start()
        t.join(60)
        assert not t.is_alive(), "the monitor's read never returned while a relay flooded it"
        steady_sent = sent_at[-1] - start if sent_at else sent.value - start
        assert counts["flood"] > counts["steady"]  # it did flood
        assert counts["steady"] >= 0.8 * steady_sent > 0, (counts, steady_sent)
    finally:
        stop.set()
        reader.close()
        flood.terminate()
        steady.terminate()
