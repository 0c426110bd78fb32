"""The monitor's connection to one agent: a DEALER for requests, a SUB for the batch stream.

Every frame is validated (wire.decode); a bad one is counted with its reason and dropped.
Agents ship their probe's log; the client replays it (model/log_replay.LogReplay) and hands each
batch and snapshot reply up with the steps replayed from it, so everything above it sees steps.
Synchronous on purpose: the TUI runs it in a worker thread, `report` runs it directly.
"""

from __future__ import annotations

import itertools
import math
import time
from typing import Any, NamedTuple

import zmq

from torchtop.contract import wire
from torchtop.contract.request_commands import Command
from torchtop.monitor.link.targets import Endpoint, rediscover
from torchtop.monitor.model.budget import StepBudget
from torchtop.monitor.model.log_replay import LogReplay
from torchtop.monitor.model.steps import StepRecord

RESEND_S = 0.25  # no answer this long: an idempotent request is sent again
IDEMPOTENT = ("hello", "ping", "memory", "capture-status")  # a snapshot is costly: asked once


class AgentUnreachable(Exception):
    """No answer from the agent in time: a closed port, a dead agent, or the wrong host."""


class Received(NamedTuple):
    """A batch off the stream and the steps replayed from its log."""

    batch: wire.Batch
    steps: list[StepRecord]
    log_errors: int = 0  # malformed log entries the replay skipped so far (cumulative)


class Snapshot(NamedTuple):
    """A snapshot reply and the steps replayed from its log."""

    reply: wire.Reply
    steps: list[StepRecord]


class AgentClient:
    def __init__(self, endpoint: Endpoint, ctx: Any = None) -> None:
        self.endpoint = endpoint
        self.ctx = ctx or zmq.Context.instance()
        self._ids = itertools.count(1)
        self.bad_frames = 0
        self.last_error = ""
        self.replay = LogReplay()
        self.budget: StepBudget | None = None  # replay a bounded sample of the steps (the exporter)
        self.dealer: Any = None
        self.sub: Any = None
        self._ipv6 = int(endpoint.ipv6)  # zmq sockets are IPv4-only unless told otherwise
        self._new_sub()
        self._new_dealer()

    def _new_sub(self) -> None:
        if self.sub is not None:
            self.sub.close(linger=0)
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.IPV6, self._ipv6)
        self.sub.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME_BYTES)
        self.sub.setsockopt(zmq.RCVHWM, 10_000)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.SUBSCRIBE, wire.WATCH_TOPIC)  # a monitor watches: the agent's probes run
        self._secure(self.sub)
        self.sub.connect(self.endpoint.pub_address)

    def _new_dealer(self) -> None:
        if self.dealer is not None:
            self.dealer.close(linger=0)
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.setsockopt(zmq.IPV6, self._ipv6)
        self.dealer.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME_BYTES)
        self._secure(self.dealer)
        self.dealer.connect(self.endpoint.address)

    def _secure(self, sock: Any) -> None:
        """CURVE client options, when the endpoint names the agent's public key."""
        curve = self.endpoint.curve
        if curve is not None:
            sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server_public)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret)

    def close(self) -> None:
        for sock in (self.dealer, self.sub):
            try:
                sock.close(linger=0)
            except Exception:  # broad: best-effort cleanup
                pass

    def _bad(self, reason: str) -> None:
        self.bad_frames += 1
        self.last_error = reason

    # -- requests ------------------------------------------------------------------------------
    def request(self, cmd: str, args: dict[str, Any] | None = None, timeout: float = 2.0) -> wire.Reply:
        """Send one request and wait for its reply; raise AgentUnreachable after `timeout`."""
        req_id = next(self._ids)
        req = wire.Request(v=wire.PROTOCOL_VERSION, id=req_id, cmd=cmd, args=args or {})
        deadline_ms = int(timeout * 1000)
        try:
            self.dealer.send(wire.encode(req), zmq.NOBLOCK)
        except zmq.Again:  # no pipe to the agent now (a refused CURVE handshake drops it): wait
            if self.dealer.poll(deadline_ms, zmq.POLLOUT):
                self.dealer.send(wire.encode(req), zmq.NOBLOCK)
            else:
                deadline_ms = 0
        poller = zmq.Poller()
        poller.register(self.dealer, zmq.POLLIN)

        end = time.monotonic() + timeout
        bad_before = self.bad_frames
        # a request the agent lost (its socket renewed under a frame bomb) is asked again; only
        # those that change nothing, and the same id: a late first answer is as good
        resend_at = time.monotonic() + RESEND_S if cmd in IDEMPOTENT else float("inf")
        while deadline_ms > 0:
            wait_ms = deadline_ms
            if resend_at != float("inf"):
                wait_ms = min(wait_ms, max(1, math.ceil((resend_at - time.monotonic()) * 1000)))
            if not poller.poll(wait_ms):
                now = time.monotonic()
                if now >= end - 0.001:
                    break
                if now >= resend_at - 0.002:
                    resend_at = now + RESEND_S
                    try:
                        self.dealer.send(wire.encode(req), zmq.NOBLOCK)
                    except zmq.Again:
                        pass
                deadline_ms = int((end - now) * 1000)
                continue
            frame = self.dealer.recv()
            try:
                reply = wire.decode(frame)
            except wire.WireError as exc:
                self._bad(str(exc))
            else:
                if isinstance(reply, wire.Reply) and reply.id == req_id:
                    return reply
                if not isinstance(reply, wire.Reply):
                    self._bad(f"expected a reply, got {type(reply).__name__}")
            deadline_ms = int((end - time.monotonic()) * 1000)
        self._new_dealer()  # drop the queued request: a late reply must not be read as another's
        why = self._why() if self.bad_frames == bad_before else f"invalid frames came back: {self.last_error}"
        self._renew()
        raise AgentUnreachable(
            f"no answer from a torchtop agent at {self.endpoint.address} within {timeout:g}s ({why})"
        )

    def _renew(self) -> None:
        """A local run restarted where we point (same port) has new CURVE keys in its discovery
        entry: take them, so that the next request reaches it."""
        fresh = rediscover(self.endpoint)
        if fresh is not None and fresh.curve != self.endpoint.curve:
            self.endpoint = fresh
            self._new_sub()
            self._new_dealer()

    def _why(self) -> str:
        if self.endpoint.curve is not None:
            return (
                "closed port, agent gone, or it does not accept this CURVE key pair: check --server-key "
                "and that your client.key is in the agent's authorized_keys"
            )
        if self.endpoint.transport == "ipc":
            return "agent gone, or its socket belongs to another user"
        return (
            "closed port, agent gone, or wrong host/port; an agent on TCP answers only CURVE clients: "
            "attach by pid on its machine, over ssh://, or with --server-key"
        )

    def hello(self, timeout: float = 3.0) -> wire.Hello:
        reply = self.request(Command.HELLO, timeout=timeout)
        if not reply.ok or reply.hello is None:
            raise AgentUnreachable(f"agent refused hello: {reply.error or 'no hello in reply'}")
        return reply.hello

    def memory(self, timeout: float = 3.0) -> list[wire.MemoryLow]:
        """The agent's per-second memory lows (the last ten minutes), for the leak rule."""
        reply = self.request(Command.MEMORY, timeout=timeout)
        return list(reply.memory) if reply.ok else []

    def snapshot(self, max_steps: int = 10_000, timeout: float = 5.0) -> Snapshot:
        """The agent's recent history, replayed afresh: the last `max_steps` steps beside the
        reply. The stream's replay then continues from the snapshot's last chunk (batches it
        covers are skipped), so a snapshot is current even after a gap in the stream."""
        reply = self.request(Command.SNAPSHOT, {"max_steps": max_steps}, timeout=timeout)
        steps: list[StepRecord] = []
        if reply.ok:
            replay = LogReplay(reply.run_id)
            steps = replay.feed(reply.log, reply.wall_offset, reply.rank, flush=True)[-max_steps:]
            if reply.log:
                replay.rec.failures += self.replay.failures if self.replay.run_id == reply.run_id else 0
                self.replay = replay
        return Snapshot(reply, steps)

    def _replay(
        self, run_id: str, log: list[wire.LogChunk], wall_offset: float, rank: int
    ) -> list[StepRecord]:
        if run_id != self.replay.run_id:  # another run on this endpoint: its chunks count from 0
            self.replay = LogReplay(run_id)
            if self.budget is not None:
                self.budget = StepBudget(self.budget.rate)
        if self.budget is not None:
            log = self.budget.filter(log, time.monotonic())
        return self.replay.feed(log, wall_offset, rank)

    # -- stream --------------------------------------------------------------------------------
    def recv_batches(self, timeout: float) -> list[Received]:
        """Batches that arrive within `timeout` seconds (returns early once one has arrived),
        each with the steps replayed from its log."""
        out: list[Received] = []
        if not self.sub.poll(int(timeout * 1000)):
            return out
        while True:
            try:
                frame = self.sub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                msg = wire.decode(frame)
            except wire.WireError as exc:
                self._bad(str(exc))
                continue
            if isinstance(msg, wire.Batch):
                steps = self._replay(msg.run_id, msg.log, msg.wall_offset, msg.rank)
                out.append(Received(msg, steps, self.replay.failures))
            else:
                self._bad(f"expected a batch on the stream, got {type(msg).__name__}")
