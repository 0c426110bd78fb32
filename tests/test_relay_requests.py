"""A relay's own sockets: it answers hello with where it is and its ranks, refuses a request for a
rank it does not have in one line, and survives garbage on its ROUTER and XPUB (real sockets)."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest
import zmq

from torchtop.contract import wire
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
        refused = wire.decode(dealer.recv())
        assert isinstance(refused, wire.Reply) and not refused.ok  # a bad frame: refused with its reason
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


@pytest.mark.slow  # among the fast subset's slowest, ~2.1 s here (issue 27: the subset under 60 s)
def test_a_relay_on_tcp_serves_only_authorized_curve_keys(tmp_path: Path, monkeypatch) -> None:
    from tests.agent_util import free_port
    from torchtop.contract import curve_keys
    from torchtop.monitor.commands import keys as keys_cli
    from torchtop.monitor.link.relay_link import RelayReader
    from torchtop.monitor.link.relay_targets import direct_endpoint, direct_target

    relay = Relay("job@h:1", "nodeY", tmp_path, source=lambda: [])
    with pytest.raises(curve_keys.KeyConfigError):
        relay.listen_tcp("0.0.0.0", free_port())  # no keys: never on TCP
    assert relay.tcp is None and "server_key" not in relay.entry().to_json()
    server_cfg, monitor_cfg = tmp_path / "server", tmp_path / "monitor"
    monkeypatch.setenv(curve_keys.ENV_CONFIG, str(monitor_cfg))
    client_public = keys_cli.make_pair("client")[0]
    monkeypatch.setenv(curve_keys.ENV_CONFIG, str(server_cfg))
    keys_cli.make_pair("server")
    keys_cli.authorize(str(client_public), "monitor")
    port = free_port()
    relay.listen_tcp("127.0.0.1", port)
    entry = relay.entry()
    assert entry.tcp_address == f"tcp://127.0.0.1:{port}" and len(entry.server_key or "") == 40
    assert not any("secret" in k or k == "client_key" for k in entry.to_json())  # what goes into the store
    stop = threading.Event()
    thread = threading.Thread(target=relay.run, args=(stop, 3600.0), daemon=True)
    thread.start()
    monkeypatch.setenv(curve_keys.ENV_CONFIG, str(monitor_cfg))
    assert direct_target(entry) is None  # a key only the entry (the store) gives: not trusted
    known = monitor_cfg / "keys" / curve_keys.KNOWN_SERVERS
    known.mkdir(parents=True)
    shutil.copy(server_cfg / "keys" / "server.key", known / "nodeY.key")  # the user's own copy
    target = direct_target(entry)
    assert target is not None
    good = RelayReader([direct_endpoint(target)])
    stranger_ctx = zmq.Context()
    stranger = stranger_ctx.socket(zmq.SUB)  # no key: the NULL mechanism, refused
    stranger.setsockopt(zmq.SUBSCRIBE, b"")
    stranger.connect(f"tcp://127.0.0.1:{port + 1}")
    try:
        from torchtop.monitor.link.job_link import Event

        got: list = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(e.kind == "summary" for e in got):
            time.sleep(0.2)
            got += good.read(time.monotonic(), Event)
        assert any(e.kind == "summary" and e.summary.node == "nodeY" for e in got)
        assert not stranger.poll(1000)  # nothing reached the client without a key
        local = stranger_ctx.socket(zmq.SUB)  # the private ipc end is as it was: no CURVE
        local.setsockopt(zmq.SUBSCRIBE, b"S")
        local.connect(relay.pub_address)
        try:
            assert local.poll(5000)
        finally:
            local.close(linger=0)
    finally:
        stop.set()
        thread.join(5)
        good.close()
        stranger.close(linger=0)
        stranger_ctx.term()
        relay.close()
