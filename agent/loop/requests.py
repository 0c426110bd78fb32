"""Requests on the agent's ROUTER socket: read frame by frame within a budget, answered fairly.

The router takes what a monitor sends (hello, ping, snapshot, memory, captures) and answers each with a
`Reply` of the same id; a malformed request is counted and answered with a short error. Nothing a
peer sends can make the agent thread do unbounded work or keep unbounded memory:

- a request is read one frame at a time (RCVMORE): more than MAX_REQUEST_FRAMES frames or
  MAX_REQUEST_BYTES bytes and the rest of it is read off and discarded, never kept nor echoed
  (one short error says so), and its peer is ignored for BAN_S (a ROUTER cannot disconnect a
  peer: its frames are still read, within the budget, and dropped);
- a message of more than DISCARD_MAX frames (a frame bomb: ZeroMQ holds a multipart message
  whole, ~64 bytes a frame, before the first frame can be read) is not read off: `renew` asks
  the loop for a fresh ROUTER socket (sockets.renew_router), which frees it at once; peers
  reconnect by themselves, and a request lost with the old socket is sent again by its client;
- the agent thread reads at most FRAMES_PER_WINDOW frames (and DISCARD_PER_WINDOW frames of
  oversized messages) and answers at most ANSWERS_PER_WINDOW requests in each WINDOW_S; the rest stays queued in the socket (whose
  RCVHWM bounds it);
- each peer gets at most PEER_ANSWERS_PER_WINDOW answers a window; one request past that waits
  for the next window, more are read and dropped (counted). ZeroMQ reads peers round-robin, so a
  flooding peer's queue never stands in front of another peer's request for longer than a window;
- snapshots (the costly answer: the whole history, encoded) go out at most once per
  SNAPSHOT_EVERY_S; one asked meanwhile waits its turn.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from torchtop.agent.capture.arguments import CaptureError
from torchtop.contract import wire
from torchtop.contract.request_commands import CAPTURE_COMMANDS, Command

if TYPE_CHECKING:
    from torchtop.agent.capture.controller import CaptureController
    from torchtop.agent.loop.history import LogHistory
    from torchtop.agent.loop.tally import StepCounter

SNAPSHOT_MAX = wire.SNAPSHOT_MAX_STEPS
MAX_REQUEST_FRAMES = 3  # after the routing id: a request, with an empty delimiter (REQ) and one spare
MAX_REQUEST_BYTES = 1 << 20  # a request is a few hundred bytes; a frame over this is refused by zmq
WINDOW_S = 0.02  # budgets refill this often: a monitor's request waits at most this for one
FRAMES_PER_WINDOW = 400  # ~1 us each: at most ~2% of a core reading, whatever arrives
ANSWERS_PER_WINDOW = 25  # a hello costs ~20 us: ~2.5% of a core at most
PEER_ANSWERS_PER_WINDOW = 8  # a monitor waits for each answer: it never asks this fast
SNAPSHOT_EVERY_S = 0.1
WAITING_MAX = 64  # requests kept for a later window (one a peer); beyond these, dropped
DISCARD_PER_WINDOW = 2000  # frames of oversized messages read off and dropped (~2 ms a window)
DISCARD_MAX = 4 * DISCARD_PER_WINDOW  # frames of one message read off before the socket is renewed
BAN_S = 10.0  # a peer that sent an oversized request is ignored this long
BANNED_MAX = 1024  # peers remembered (the oldest ban goes first)
TOO_LARGE = wire.Reply(
    v=wire.PROTOCOL_VERSION,
    id=-1,
    ok=False,
    error=f"request too large (over {MAX_REQUEST_FRAMES} frames or {MAX_REQUEST_BYTES} bytes): "
    f"dropped, and this connection ignored for {BAN_S:g} s",
)


class RequestRouter:
    """Answers requests from what the agent loop holds: its hello, history, step counts, captures."""

    def __init__(
        self,
        hello: Callable[[], wire.Hello],
        history: LogHistory,
        last_seq: Callable[[], int],
        run_id: str,
        rank: int,
        wall_offset: float,
        captures: CaptureController | None = None,
        counter: StepCounter | None = None,
        memory: Callable[[], list[wire.MemoryLow]] | None = None,
    ) -> None:
        self.hello = hello
        self.memory = memory or list  # the per-second memory lows (telemetry/memory_trend.py)
        self.history = history
        self.counter = counter
        self.last_seq = last_seq  # the last batch published when a reply is built
        self.run_id = run_id
        self.rank = rank
        self.wall_offset = wall_offset
        self.captures = captures
        self.bad_requests = 0  # malformed or oversized
        self.dropped_requests = 0  # read and not answered: a banned peer's, or a flood's excess
        self.dropped_frames = 0  # frames of oversized requests, read off and discarded
        self.banned: dict[bytes, float] = {}  # routing id -> until (monotonic)
        self.frames = FRAMES_PER_WINDOW  # left in this window
        self.discards = DISCARD_PER_WINDOW
        self.answers = ANSWERS_PER_WINDOW
        self._answered: dict[bytes, int] = {}  # per peer, this window
        self._discarding = False  # inside an oversized message: its remaining frames go
        self._discarded = 0  # frames of that message read off so far
        self.renew = False  # a frame bomb: the loop replaces the socket (and clears this)
        self.renewals = 0
        self._snapshot_due = 0.0
        # one request per peer past its share (or a snapshot before its turn), answered in a later
        # window: a monitor waits for each answer, so it never has two
        self._waiting: dict[bytes, tuple[list[bytes], wire.Request]] = {}

    # -- budget --------------------------------------------------------------------------------
    def refill(self, router: Any, now: float) -> None:
        """A new window: budgets back to full, then the requests that waited for it."""
        self.frames = FRAMES_PER_WINDOW
        self.discards = DISCARD_PER_WINDOW
        self.answers = ANSWERS_PER_WINDOW
        self._answered.clear()
        for peer, (envelope, req) in list(self._waiting.items()):
            if self.answers <= 0:
                return
            del self._waiting[peer]
            self._handle(router, peer, envelope, req, now)

    def starved(self) -> bool:
        """The window's budget is spent (what is queued waits for the next one)."""
        return self.frames <= 0 or self.answers <= 0 or (self._discarding and self.discards <= 0)

    def waiting(self) -> bool:
        return bool(self._waiting)

    # -- reading -------------------------------------------------------------------------------
    def serve(self, router: Any, now: float) -> None:
        """Read and answer what waits on `router`, within this window's budget."""
        while self.frames > 0 and self.answers > 0 and not self.renew:
            if self._discarding:
                if self.discards <= 0:
                    return  # the rest of it in the next window
                self._discard(router)
                continue
            try:
                peer = router.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.frames -= 1
            if not router.getsockopt(zmq.RCVMORE):  # a routing id and nothing else
                self.bad_requests += 1
                continue
            if self._is_banned(peer, now) or peer in self._waiting:
                self.dropped_requests += 1  # banned, or a second request before its first's turn
                self._discarding, self._discarded = True, 1
                continue
            parts = self._read_request(router)
            if parts is None:  # oversized: the rest of it is discarded, its peer ignored a while
                self.bad_requests += 1
                self._ban(peer, now)
                self._send(router, [peer], TOO_LARGE)
                continue
            envelope = [peer, *parts[:-1]]
            req = self._decode(parts[-1])
            if isinstance(req, wire.Reply):  # malformed: a short error at once
                self._count(peer)
                self._send(router, envelope, req)
            else:
                self._handle(router, peer, envelope, req, now)

    def _handle(self, router: Any, peer: bytes, envelope: list[bytes], req: wire.Request, now: float) -> None:
        """Answer `req` now, or keep it for a later window (its peer's share or the snapshot
        rate spent); with too many kept, drop it."""
        snapshot = req.cmd == Command.SNAPSHOT
        if self._answered.get(peer, 0) >= PEER_ANSWERS_PER_WINDOW or (snapshot and now < self._snapshot_due):
            if len(self._waiting) < WAITING_MAX:
                self._waiting[peer] = (envelope, req)
            else:
                self.dropped_requests += 1
            return
        if snapshot:
            self._snapshot_due = now + SNAPSHOT_EVERY_S
        self._count(peer)
        self._send(router, envelope, self.answer(req))

    def _count(self, peer: bytes) -> None:
        self._answered[peer] = self._answered.get(peer, 0) + 1
        self.answers -= 1

    def _read_request(self, router: Any) -> list[bytes] | None:
        """The frames after the routing id, or None when there are too many or too large (then
        `_discarding` says whether frames of it are left to read)."""
        parts: list[bytes] = []
        size = 0
        while True:
            part = router.recv(zmq.NOBLOCK)  # never Again inside a message: delivery is atomic
            self.frames -= 1
            size += len(part)
            more = router.getsockopt(zmq.RCVMORE)
            if size > MAX_REQUEST_BYTES or (more and len(parts) + 1 >= MAX_REQUEST_FRAMES):
                self.dropped_frames += len(parts) + 1
                self._discarding = bool(more)
                self._discarded = len(parts) + 1
                return None
            parts.append(part)
            if not more:
                return parts

    def _discard(self, router: Any) -> None:
        """Read off (and drop) the rest of a message, within the budget."""
        recv, rcvmore = router.recv, router.getsockopt
        while self.discards > 0:
            if self._discarded >= DISCARD_MAX:  # a bomb: the socket goes, and the message with it
                self.renew, self._discarding = True, False
                return
            try:
                recv(zmq.NOBLOCK)
            except zmq.Again:
                self._discarding = False  # nothing left (the peer went away mid-message)
                return
            self.discards -= 1
            self.dropped_frames += 1
            self._discarded += 1
            if not rcvmore(zmq.RCVMORE):
                self._discarding = False
                return

    def renewed(self) -> None:
        """The loop replaced the socket: what was queued on the old one is gone."""
        self.renew, self._discarding, self._discarded = False, False, 0
        self.renewals += 1
        self._waiting.clear()  # their envelopes named pipes of the old socket

    def _is_banned(self, peer: bytes, now: float) -> bool:
        until = self.banned.get(peer)
        if until is None:
            return False
        if now < until:
            return True
        del self.banned[peer]
        return False

    def _ban(self, peer: bytes, now: float) -> None:
        if len(self.banned) >= BANNED_MAX:
            del self.banned[next(iter(self.banned))]
        self.banned.pop(peer, None)
        self.banned[peer] = now + BAN_S

    @staticmethod
    def _send(router: Any, envelope: list[bytes], reply: wire.Reply) -> None:
        try:
            router.send_multipart([*envelope, wire.encode(reply)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    # -- answering -----------------------------------------------------------------------------
    def _decode(self, payload: bytes) -> wire.Request | wire.Reply:
        """The request, or the error reply to a frame that is not one."""
        v = wire.PROTOCOL_VERSION
        try:
            req = wire.decode(payload)
        except wire.WireError as exc:
            self.bad_requests += 1
            return wire.Reply(v=v, id=-1, ok=False, error=f"bad request: {exc}")
        if not isinstance(req, wire.Request):
            self.bad_requests += 1
            return wire.Reply(v=v, id=-1, ok=False, error=f"expected a request, got {type(req).__name__}")
        return req

    def answer(self, req: wire.Request) -> wire.Reply:
        v = wire.PROTOCOL_VERSION
        if req.cmd == Command.HELLO:
            return wire.Reply(v=v, id=req.id, ok=True, hello=self.hello(), seq=self.last_seq())
        if req.cmd == Command.PING:
            return wire.Reply(v=v, id=req.id, ok=True, seq=self.last_seq())
        if req.cmd == Command.SNAPSHOT:
            return self._snapshot(req)
        if req.cmd == Command.MEMORY:
            return wire.Reply(v=v, id=req.id, ok=True, run_id=self.run_id, memory=self.memory())
        if req.cmd in CAPTURE_COMMANDS and self.captures is not None:
            return self._capture(req, self.captures)
        self.bad_requests += 1
        return wire.Reply(v=v, id=req.id, ok=False, error=f"unknown command {req.cmd[:64]!r}")

    def _snapshot(self, req: wire.Request) -> wire.Reply:
        v = wire.PROTOCOL_VERSION
        limit = req.args.get("max_steps", SNAPSHOT_MAX)
        if not isinstance(limit, int) or isinstance(limit, bool) or not 0 < limit <= SNAPSHOT_MAX:
            return wire.Reply(
                v=v, id=req.id, ok=False, error=f"max_steps must be an integer in 1..{SNAPSHOT_MAX}"
            )
        return wire.Reply(
            v=v,
            id=req.id,
            ok=True,
            run_id=self.run_id,
            log=self.history.snapshot(limit),
            wall_offset=self.wall_offset,
            rank=self.rank,
            seq=self.last_seq(),
            memory=self.memory(),
            tally=self.counter.tally() if self.counter is not None else None,
        )

    def _capture(self, req: wire.Request, captures: CaptureController) -> wire.Reply:
        v = wire.PROTOCOL_VERSION
        if req.cmd == Command.CAPTURE_STATUS:
            return wire.Reply(v=v, id=req.id, ok=True, capture=captures.current, captures=captures.status())
        try:
            info = captures.request(req.cmd, req.args)
        except CaptureError as exc:
            return wire.Reply(v=v, id=req.id, ok=False, error=str(exc), capture=captures.current)
        return wire.Reply(v=v, id=req.id, ok=True, capture=info)
