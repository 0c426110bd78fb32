"""Requests on the agent's ROUTER socket: read within a budget, decoded, answered.

The router takes what a monitor sends (hello, ping, snapshot, captures) and answers each with a
`Reply` of the same id; a bad frame is counted and answered with an error. Nothing a client
sends can stop the agent thread or make it do unbounded work: the loop gives it a budget of
requests per tick.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from torchtop.agent.capture.controller import CaptureError
from torchtop.agent.contract import wire

if TYPE_CHECKING:
    from torchtop.agent.capture.controller import CaptureController
    from torchtop.agent.loop.history import LogHistory

SNAPSHOT_MAX = wire.SNAPSHOT_MAX_STEPS
CAPTURE_COMMANDS = ("capture-profile", "capture-memory", "capture-status")


class RequestRouter:
    """Answers requests from what the agent loop holds: its hello, history and captures."""

    def __init__(
        self,
        hello: Callable[[], wire.Hello],
        history: LogHistory,
        last_seq: Callable[[], int],
        run_id: str,
        rank: int,
        wall_offset: float,
        captures: CaptureController | None = None,
    ) -> None:
        self.hello = hello
        self.history = history
        self.last_seq = last_seq  # the last batch published when a reply is built
        self.run_id = run_id
        self.rank = rank
        self.wall_offset = wall_offset
        self.captures = captures
        self.bad_requests = 0

    def serve(self, router: Any, budget: int) -> int:
        """Answer the requests waiting on `router`, at most `budget`; how many were read."""
        used = 0
        while used < budget:
            used += 1
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return used
            if len(frames) < 2:
                self.bad_requests += 1
                continue
            envelope, payload = frames[:-1], frames[-1]
            reply = self.answer(payload)
            try:
                router.send_multipart([*envelope, wire.encode(reply)], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        return used

    def answer(self, payload: bytes) -> wire.Reply:
        v = wire.PROTOCOL_VERSION
        try:
            req = wire.decode(payload)
        except wire.WireError as exc:
            self.bad_requests += 1
            return wire.Reply(v=v, id=-1, ok=False, error=f"bad request: {exc}")
        if not isinstance(req, wire.Request):
            self.bad_requests += 1
            return wire.Reply(v=v, id=-1, ok=False, error=f"expected a request, got {type(req).__name__}")
        if req.cmd == "hello":
            return wire.Reply(v=v, id=req.id, ok=True, hello=self.hello(), seq=self.last_seq())
        if req.cmd == "ping":
            return wire.Reply(v=v, id=req.id, ok=True, seq=self.last_seq())
        if req.cmd == "snapshot":
            return self._snapshot(req)
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
        )

    def _capture(self, req: wire.Request, captures: CaptureController) -> wire.Reply:
        v = wire.PROTOCOL_VERSION
        if req.cmd == "capture-status":
            return wire.Reply(v=v, id=req.id, ok=True, capture=captures.current, captures=captures.status())
        try:
            info = captures.request(req.cmd, req.args)
        except CaptureError as exc:
            return wire.Reply(v=v, id=req.id, ok=False, error=str(exc), capture=captures.current)
        return wire.Reply(v=v, id=req.id, ok=True, capture=info)
