"""The monitor's side of the nodes' relays: one SUB and one DEALER per node, however many ranks.

Each relay publishes its node's summary under topic `S` (monitor/relay/node.py); the reader
subscribes to that, and to `R<rank>.` while the user drills into one of its ranks (that rank's
full stream then arrives as the agent's own batches, replayed here as for a direct connection).
Requests for a relayed rank go to its relay with `args["rank"]`; the relay forwards them and
routes the reply back. A relay silent for SILENT_AFTER_S is said once per silence (`error`
events: its node's ranks are then "not reporting"); the SUB reconnects by itself. Synchronous,
read from JobLink's poll: no textual, no torch.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from torchtop.contract import wire
from torchtop.monitor.link.client import Received
from torchtop.monitor.link.targets import Endpoint
from torchtop.monitor.model.log_replay import LogReplay
from torchtop.monitor.model.relayed import MAX_NODE_RANKS, MAX_WORLD, SILENT_AFTER_S, member_key

SUMMARY_TOPIC = b"S"
REQUEST_TIMEOUT_S = 10.0
# frames read from one relay's socket a call (a relay sends 2 summaries a second, a followed
# rank ~10 batches): a relay that floods waits its turn, the other nodes are read
READ_BUDGET = 64


def rank_topic(rank: int) -> bytes:
    return b"R%d." % rank


@dataclass
class _Relay:
    endpoint: Endpoint
    sub: Any
    dealer: Any
    ranks: dict[int, str] = field(default_factory=dict)  # rank -> its member key
    last: float = field(default_factory=time.monotonic)
    said_silent: bool = False
    following: int | None = None
    replay: LogReplay = field(default_factory=LogReplay)
    bad_frames: int = 0


class RelayReader:
    def __init__(self, endpoints: list[Endpoint], ctx: Any = None) -> None:
        self.ctx = ctx or zmq.Context.instance()
        self.relays: dict[str, _Relay] = {}
        self._ids = itertools.count(1)
        self._asked: dict[int, tuple[str, str, str, float]] = {}  # id -> (relay, member key, cmd, t)
        # one call says which sockets hold frames: trying 256 sockets 10 times a second cost ~3% of a core
        self._poller = zmq.Poller()
        for ep in endpoints:
            self.relays[str(ep)] = self._open(ep)

    def _open(self, ep: Endpoint) -> _Relay:
        sub = self.ctx.socket(zmq.SUB)
        dealer = self.ctx.socket(zmq.DEALER)
        for sock in (sub, dealer):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IPV6, int(ep.ipv6))
            sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME_BYTES)
            if ep.curve is not None:
                sock.setsockopt(zmq.CURVE_SERVERKEY, ep.curve.server_public)
                sock.setsockopt(zmq.CURVE_PUBLICKEY, ep.curve.public)
                sock.setsockopt(zmq.CURVE_SECRETKEY, ep.curve.secret)
        sub.setsockopt(zmq.RCVHWM, 10_000)
        sub.setsockopt(zmq.SUBSCRIBE, SUMMARY_TOPIC)
        sub.connect(ep.pub_address)
        dealer.connect(ep.address)
        self._poller.register(sub, zmq.POLLIN)
        self._poller.register(dealer, zmq.POLLIN)
        return _Relay(ep, sub, dealer)

    def close(self) -> None:
        for r in self.relays.values():
            r.sub.close(linger=0)
            r.dealer.close(linger=0)

    def owner(self, key: str) -> tuple[str, int] | None:
        """(relay, rank) of a relayed member's key; None for a member of its own."""
        for name, r in self.relays.items():
            for rank, k in r.ranks.items():
                if k == key:
                    return name, rank
        return None

    def keys(self) -> list[str]:
        return [k for r in self.relays.values() for k in r.ranks.values()]

    # -- drilling into one rank ----------------------------------------------------------------
    def follow(self, key: str | None) -> None:
        """Receive this relayed rank's full stream (None: no rank's); others' stop."""
        want = self.owner(key) if key is not None else None
        for name, r in self.relays.items():
            rank = want[1] if want is not None and want[0] == name else None
            if r.following == rank:
                continue
            if r.following is not None:
                r.sub.setsockopt(zmq.UNSUBSCRIBE, rank_topic(r.following))
            if rank is not None:
                r.sub.setsockopt(zmq.SUBSCRIBE, rank_topic(rank))
                r.replay = LogReplay()
            r.following = rank

    # -- requests ------------------------------------------------------------------------------
    def request(self, key: str, cmd: str, args: dict[str, Any]) -> str:
        """Send a request for a relayed rank; "" when sent, else why not."""
        found = self.owner(key)
        if found is None:
            return "not a rank of a relayed node"
        name, rank = found
        req_id = next(self._ids)
        req = wire.Request(v=wire.PROTOCOL_VERSION, id=req_id, cmd=cmd, args={**args, "rank": rank})
        try:
            self.relays[name].dealer.send(wire.encode(req), zmq.NOBLOCK)
        except zmq.Again:
            return f"the relay on {name} is not taking requests"
        self._asked[req_id] = (name, key, cmd, time.monotonic())
        return ""

    # -- reading -------------------------------------------------------------------------------
    def read(self, now: float, Event: Any) -> list[Any]:  # noqa: N803
        """Events since the last call, made by `Event` (JobLink's event type: link/job.py)."""
        out: list[Any] = []
        ready = {sock for sock, _ in self._poller.poll(0)}
        for name, r in self.relays.items():
            got_any = False
            for _ in range(READ_BUDGET if r.sub in ready else 0):
                try:
                    frames = r.sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(frames) != 2:
                    r.bad_frames += 1
                    continue
                topic, frame = frames
                try:
                    msg = wire.decode(frame)
                except wire.WireError:
                    r.bad_frames += 1
                    continue
                if topic == SUMMARY_TOPIC and isinstance(msg, wire.NodeSummary):
                    got_any = True
                    for rs in msg.ranks[:MAX_NODE_RANKS]:  # the model checks them (relayed.py)
                        if 0 <= rs.rank < MAX_WORLD:
                            r.ranks.setdefault(rs.rank, member_key(name, rs.rank))
                    out.append(Event(name, "summary", summary=msg))
                elif (
                    isinstance(msg, wire.Batch)
                    and r.following is not None
                    and topic == rank_topic(r.following)
                ):
                    if msg.run_id != r.replay.run_id:
                        r.replay = LogReplay(msg.run_id)
                    steps = r.replay.feed(msg.log, msg.wall_offset, msg.rank)
                    key = r.ranks.get(r.following, member_key(name, r.following))
                    out.append(Event(key, "stream", batches=[Received(msg, steps, r.replay.failures)]))
                else:
                    r.bad_frames += 1
            if got_any:
                r.last, r.said_silent = now, False
            elif now - r.last > SILENT_AFTER_S and not r.said_silent:
                r.said_silent = True
                out.append(
                    Event(name, "relay-silent", error=f"no summary from the relay for {now - r.last:.0f} s")
                )
            for _ in range(READ_BUDGET if r.dealer in ready else 0):
                try:
                    frame = r.dealer.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    reply = wire.decode(frame)
                except wire.WireError:
                    r.bad_frames += 1
                    continue
                if isinstance(reply, wire.Reply) and reply.id in self._asked:
                    _, key, cmd, _ = self._asked.pop(reply.id)
                    out.append(Event(key, "reply", cmd=cmd, reply=reply))
        for req_id, (_, key, cmd, t) in list(self._asked.items()):
            if now - t > REQUEST_TIMEOUT_S:
                del self._asked[req_id]
                out.append(Event(key, "reply", cmd=cmd, error="no answer through the relay"))
        return out
