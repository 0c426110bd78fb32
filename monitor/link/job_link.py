"""The monitor's link to every rank of a job: one AgentClient per agent, one poll over them all.

`JobLink.poll(timeout)` returns what happened since the last call as `Event`s keyed by the
member (its endpoint's label): hellos, snapshots (the history before we joined), batches, and
errors (`lost` once a member that had answered stops). Hellos and snapshots run on a small
thread pool, so 64 ranks, some dead, connect in a second or two rather than one after another;
while a member's hello or snapshot is in flight its stream is not read (its client is used by
one thread at a time, and its batches wait in the socket). The streams of connected members are
read with one zmq poll. Synchronous on purpose: the TUI runs it in a worker thread, `report`
directly. No textual, no torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import zmq

from torchtop.contract import wire
from torchtop.monitor.link.client import AgentClient, AgentUnreachable, Received
from torchtop.monitor.link.relay_link import RelayReader
from torchtop.monitor.link.targets import Endpoint
from torchtop.monitor.model.job_state import JobState
from torchtop.monitor.model.relayed import RelayState, apply_summary
from torchtop.monitor.model.steps import StepRecord

HELLO_TIMEOUT_S = 1.0
SNAPSHOT_TIMEOUT_S = 3.0
RETRY_PAUSE_S = 1.0  # between hellos to a member that does not answer
SILENT_AFTER_S = 3.0  # no batch this long: say hello again (no answer: gone)
POOL = 16
MIN_POLL_S = 0.05  # streams read at most 20 times a second: each read takes what came meanwhile

EventKind = Literal["hello", "snapshot", "batches", "error", "reply", "summary", "stream", "relay-silent"]
FOLLOW = "_follow"  # a request to the link itself: receive this relayed rank's full stream


class Event(NamedTuple):
    key: str
    kind: EventKind
    hello: wire.Hello | None = None
    steps: list[StepRecord] = []
    seq: int = -1
    batches: list[Received] = []
    error: str = ""
    lost: bool = False  # the member had answered before: it is gone
    cmd: str = ""
    reply: wire.Reply | None = None
    bad_frames: int = 0  # the member's client's count so far
    tally: wire.StepTally | None = None  # a snapshot's: the agent's count of every step
    wall_offset: float = 0.0
    summary: wire.NodeSummary | None = None  # a relay's (key: the relay)


@dataclass
class _Member:
    endpoint: Endpoint
    client: AgentClient
    connected: bool = False
    ever: bool = False
    connecting: Future[list[Event]] | None = None  # hello + snapshot in flight: its stream waits
    asking: Future[list[Event]] | None = None  # a request in flight (the stream is read meanwhile)
    next_try: float = 0.0
    last_batch: float = field(default_factory=time.monotonic)
    bad_seen: int = 0


class JobLink:
    """Every member's client; `snapshot_steps` 0 skips the history on connect."""

    def __init__(
        self,
        endpoints: list[Endpoint],
        client_factory: Callable[[Endpoint], AgentClient] = AgentClient,
        snapshot_steps: int = 2_000,
        relays: list[Endpoint] | None = None,
    ) -> None:
        self.snapshot_steps = snapshot_steps
        self.members: dict[str, _Member] = {}
        for ep in endpoints:
            self.members[str(ep)] = _Member(ep, client_factory(ep))
        self._pool = ThreadPoolExecutor(
            max_workers=min(POOL, max(1, len(endpoints))), thread_name_prefix="torchtop-job"
        )
        self._requests: list[tuple[str, str, dict[str, Any]]] = []
        self._early: list[Event] = []  # replies known before anything is sent (a relay refused it)
        self._poller: Any = None
        self._reading: dict[Any, str] = {}  # the poller's sockets -> their member
        self._last_read = 0.0
        self.relayed = RelayReader(relays) if relays else None  # nodes read through their relay

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self.relayed is not None:
            self.relayed.close()
        for m in self.members.values():
            m.client.close()

    # -- connecting ----------------------------------------------------------------------------
    def _connect(self, key: str, m: _Member) -> list[Event]:
        """Pool thread: hello, then the history; events for the loop to hand up."""
        try:
            hello = m.client.hello(timeout=HELLO_TIMEOUT_S)
        except AgentUnreachable as exc:
            return [Event(key, "error", error=str(exc), lost=m.ever)]
        out = [Event(key, "hello", hello=hello)]
        if self.snapshot_steps:
            try:
                reply, steps = m.client.snapshot(self.snapshot_steps, timeout=SNAPSHOT_TIMEOUT_S)
                if reply.ok:
                    out.append(
                        Event(
                            key,
                            "snapshot",
                            steps=steps,
                            seq=reply.seq,
                            tally=reply.tally,
                            wall_offset=reply.wall_offset,
                        )
                    )
            except AgentUnreachable:
                pass  # live batches still come; only the history before we joined is missing
        return out

    def _request(self, key: str, m: _Member, cmd: str, args: dict[str, Any]) -> list[Event]:
        try:
            return [Event(key, "reply", cmd=cmd, reply=m.client.request(cmd, args, timeout=2.0))]
        except AgentUnreachable as exc:
            return [Event(key, "reply", cmd=cmd, error=str(exc))]

    def request(self, cmd: str, args: dict[str, Any], keys: list[str] | None = None) -> None:
        """Queue a request to the given members (default: all); answers come as `reply` events.
        A relayed rank's goes through its relay; FOLLOW names the relayed rank drilled into."""
        relayed = self.relayed
        if cmd == FOLLOW:
            if relayed is not None:
                relayed.follow(keys[0] if keys else None)
            return
        everyone = list(self.members) + (relayed.keys() if relayed is not None else [])
        for key in keys if keys is not None else everyone:
            if relayed is not None and key not in self.members:
                error = relayed.request(key, cmd, args)
                if error:
                    self._early.append(Event(key, "reply", cmd=cmd, error=error))
                continue
            self._requests.append((key, cmd, args))

    def _collect(self, now: float) -> list[Event]:
        out: list[Event] = []
        for key, m in self.members.items():
            if m.connecting is not None and m.connecting.done():
                events = m.connecting.result()
                m.connecting = None
                if events and events[0].kind == "hello":
                    m.connected = m.ever = True
                    m.last_batch = now
                else:
                    m.next_try = now + RETRY_PAUSE_S
                out.extend(events)
            if m.asking is not None and m.asking.done():
                out.extend(m.asking.result())
                m.asking = None
            if m.connecting is None and m.asking is None and not m.connected and now >= m.next_try:
                m.connecting = self._pool.submit(self._connect, key, m)
        pending, self._requests = self._requests, []
        for key, cmd, args in pending:
            m = self.members.get(key)
            if m is None:
                continue
            if not m.connected:
                out.append(Event(key, "reply", cmd=cmd, error="not connected to this rank"))
            elif m.asking is not None or m.connecting is not None:
                self._requests.append((key, cmd, args))  # after the one in flight
            else:
                m.asking = self._pool.submit(self._request, key, m, cmd, args)
        return out

    # -- the streams ---------------------------------------------------------------------------
    def _readers(self) -> tuple[Any, dict[Any, str]]:
        """The poller over the streams of the members connected now (kept while they are)."""
        keys = [k for k, m in self.members.items() if m.connected and m.connecting is None]
        if self._poller is None or sorted(self._reading.values()) != sorted(keys):
            self._poller = zmq.Poller()
            self._reading = {}
            for key in keys:
                sub = self.members[key].client.sub
                self._poller.register(sub, zmq.POLLIN)
                self._reading[sub] = key
        return self._poller, self._reading

    def poll(self, timeout: float) -> list[Event]:
        """What happened since the last call; waits up to `timeout` for batches (reading the
        streams at most every MIN_POLL_S: a job of many ranks sends hundreds of batches a
        second, and each read of them all costs more than the batches it takes)."""
        out = self._collect(time.monotonic())
        out, self._early = self._early + out, []
        pause = self._last_read + MIN_POLL_S - time.monotonic()
        if pause > 0:
            time.sleep(min(pause, timeout))
            timeout = max(0.0, timeout - pause)
        poller, reading = self._readers()
        if reading:
            ready = dict(poller.poll(int(timeout * 1000)))
        else:
            ready = {}
            time.sleep(min(timeout, 0.05))
        self._last_read = time.monotonic()
        now = time.monotonic()
        for sock, key in reading.items():
            m = self.members[key]
            got = m.client.recv_batches(0) if sock in ready else []
            if got or m.client.bad_frames != m.bad_seen:
                m.bad_seen = m.client.bad_frames
                out.append(
                    Event(
                        key, "batches", batches=got, error=m.client.last_error, bad_frames=m.client.bad_frames
                    )
                )
            if got:
                m.last_batch = now
            elif now - m.last_batch > SILENT_AFTER_S and m.asking is None:
                m.connected = False  # silent: hello again; no answer means gone
        if self.relayed is not None:
            out += self.relayed.read(now, Event)
        return out

    def bad_frames(self) -> int:
        return sum(m.client.bad_frames for m in self.members.values())


def apply_events(job: JobState, events: list[Event], now: float) -> None:
    """The link's events into the job's state (the report's loop and the TUI's app both)."""
    for ev in events:
        if ev.kind == "hello" and ev.hello is not None:
            job.apply_hello(ev.key, ev.hello)
        elif ev.kind == "snapshot":
            job.apply_snapshot(ev.key, ev.steps, ev.seq, ev.tally, ev.wall_offset)
        elif ev.kind == "batches":
            for got in ev.batches:
                job.apply_batch(ev.key, got.batch, got.steps, now, got.log_errors, finish=False)
            m = job.member(ev.key)
            m.state.bad_frames = max(m.state.bad_frames, ev.bad_frames)
            if ev.error:
                m.state.last_error = ev.error
        elif ev.kind == "summary" and ev.summary is not None:
            apply_summary(job, ev.key, ev.summary, now, time.time())
        elif ev.kind == "stream":  # a relayed rank drilled into: its steps for the one-rank panels
            m = job.member(ev.key)
            for got in ev.batches:
                m.state.apply_batch(got.batch, got.steps, now, got.log_errors)
        elif ev.kind == "relay-silent":
            if ev.key not in job.relays:  # never heard from: named in the coverage
                # by its target, not the tunnel's details in its label ("ssh://node2/41 (pid 41, ...)")
                job.relays[ev.key] = RelayState(ev.key.split(" (", 1)[0], error=ev.error)
        elif ev.kind == "error":
            if ev.lost:
                job.lost(ev.key, ev.error)
            elif job.member(ev.key).hello is None:
                job.member(ev.key).error = ev.error
    job.finish()
