"""A relay's own sockets: it answers hello with where it is and its ranks, refuses a request for a
rank it does not have in one line, and survives garbage on its ROUTER and XPUB (real sockets)."""

from __future__ import annotations

import threading
from pathlib import Path

import zmq

from torchtop.agent.contract import wire
from torchtop.monitor.relay.node import Relay


def _ask(dealer: zmq.Socket, req: wire.Request) -> wire.Reply:
    dealer.send(wire.encode(req))
    assert dealer.poll(5000), "no answer from the relay"
    reply = wire.decode(dealer.recv())
    assert isinstance(reply, wire.Reply)
    return reply


def test_hello_a_missing_rank_and_garbage(tmp_path: Path) -> None:
    relay = Relay("job@h:1", "nodeX", tmp_path, source=lambda: [])
    stop = threading.Event()
    thread = threading.Thread(target=relay.run, args=(stop, 3600.0), daemon=True)
    thread.start()
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(relay.address)
    xsub = ctx.socket(zmq.PUB)  # a hostile peer on the XPUB: subscription frames of nonsense
    xsub.connect(relay.pub_address)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"S")
    sub.connect(relay.pub_address)
    try:
        dealer.send(b"\x00garbage")
        assert dealer.poll(5000)
        assert not wire.decode(dealer.recv()).ok  # a bad frame: refused with its reason
        dealer.send_multipart([b"a", b"b", b"c"])  # the wrong shape: dropped
        for junk in (b"\x01", b"\x01Rx.", b"\x00R", b"\x01R99999999999999999999."):
            xsub.send(junk)
        hello = _ask(dealer, wire.Request(v=wire.PROTOCOL_VERSION, id=7, cmd="hello"))
        assert hello.ok and hello.id == 7
        assert hello.data["relay"]["node"] == "nodeX" and hello.data["relay"]["job_id"] == "job@h:1"
        assert "secret" not in str(hello.data)
        missing = _ask(
            dealer, wire.Request(v=wire.PROTOCOL_VERSION, id=8, cmd="capture-profile", args={"rank": 3})
        )
        assert not missing.ok and missing.error == "no rank 3 on node nodeX (args.rank names one)"
        assert sub.poll(5000)  # it still publishes its summaries
        topic, frame = sub.recv_multipart()
        summary = wire.decode(frame)
        assert topic == b"S" and isinstance(summary, wire.NodeSummary) and summary.node == "nodeX"
    finally:
        stop.set()
        thread.join(5)
        for sock in (dealer, xsub, sub):
            sock.close(linger=0)
        ctx.term()
        relay.close()
