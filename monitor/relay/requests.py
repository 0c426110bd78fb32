"""A relay's request desk: requests on its ROUTER answered (`hello`) or, with `args["rank"]`,
forwarded to that rank's agent, and the agent's reply routed back to whoever asked.

At most REQUEST_BUDGET requests are read a turn (node.py's loop), so a peer flooding the ROUTER
waits its turn while the ranks' streams are read; at most MAX_PENDING forwarded requests await a
reply, each for FORWARD_TIMEOUT_S.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import zmq

from torchtop.contract import wire

FORWARD_TIMEOUT_S = 30.0  # a forwarded request's reply is routed back until then
MAX_PENDING = 4096  # forwarded requests awaiting a reply: more are refused (a flood)
REQUEST_BUDGET = 256  # requests read a turn


class Desk:
    def __init__(self, router: Any, node: str, ids: Iterator[int]) -> None:
        self.router = router
        self.node = node
        self._ids = ids
        self.pending: dict[int, tuple[Any, int, float, int]] = {}  # id -> (peer, their id, t, pid)

    def answer(
        self, now: float, hello: Callable[[], dict[str, Any]], rank_of: Callable[[object], Any | None]
    ) -> None:
        """This turn's requests: `hello` makes the relay's own answer, `rank_of` finds a rank's
        agent (an object with `pid` and `dealer`) or None."""
        for _ in range(REQUEST_BUDGET):
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                continue
            peer, frame = frames
            try:
                req = wire.decode(frame)
            except wire.WireError as exc:
                self.reply(peer, 0, False, str(exc))
                continue
            if not isinstance(req, wire.Request):
                continue
            if req.cmd == "hello" and "rank" not in req.args:
                self.reply(peer, req.id, True, data=hello())
                continue
            rank = req.args.get("rank")
            target = rank_of(rank) if isinstance(rank, int) else None
            if target is None:
                self.reply(peer, req.id, False, f"no rank {rank!r} on node {self.node} (args.rank names one)")
                continue
            self._forward(peer, req, rank, target, now)

    def _forward(self, peer: Any, req: wire.Request, rank: object, target: Any, now: float) -> None:
        if len(self.pending) >= MAX_PENDING:
            self.reply(peer, req.id, False, "the relay has too many requests in flight: ask again")
            return
        fwd_id = next(self._ids)
        self.pending[fwd_id] = (peer, req.id, now, target.pid)
        args = {k: v for k, v in req.args.items() if k != "rank"}
        fwd = wire.Request(v=wire.PROTOCOL_VERSION, id=fwd_id, cmd=req.cmd, args=args)
        try:
            target.dealer.send(wire.encode(fwd), zmq.NOBLOCK)
        except zmq.Again:
            self.pending.pop(fwd_id, None)
            self.reply(peer, req.id, False, f"rank {rank} is not taking requests now")

    def route_back(self, msg: wire.Reply) -> bool:
        """An agent's reply to a forwarded request, sent to whoever asked; False: not one."""
        found = self.pending.pop(msg.id, None)
        if found is None:
            return False
        peer, their_id, _, _ = found
        msg.id = their_id
        try:
            self.router.send_multipart([peer, wire.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        return True

    def expire(self, now: float) -> None:
        for fid in [k for k, v in self.pending.items() if now - v[2] > FORWARD_TIMEOUT_S]:
            del self.pending[fid]

    def reply(
        self, peer: Any, req_id: int, ok: bool, error: str = "", data: dict[str, Any] | None = None
    ) -> None:
        reply = wire.Reply(v=wire.PROTOCOL_VERSION, id=req_id, ok=ok, error=error, data=data or {})
        try:
            self.router.send_multipart([peer, wire.encode(reply)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
