"""The agent's two ZeroMQ sockets: ROUTER for requests on `port`, PUB for batches on `port + 1`.

Loopback by default. A non-loopback bind is refused: a training process must not take orders
from whoever can reach its port.
"""

from __future__ import annotations

import ipaddress
import random
from dataclasses import dataclass
from typing import Any

import zmq

from .wire import MAX_FRAME_BYTES

PORT_RANGE = (20000, 60000)


class BindError(RuntimeError):
    """The agent cannot listen where it was asked to; the message says what to do."""


def is_loopback(host: str) -> bool:
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass
class AgentSockets:
    ctx: Any
    router: Any
    pub: Any
    bind: str
    port: int

    @property
    def pub_port(self) -> int:
        return self.port + 1

    def close(self) -> None:
        for sock in (self.router, self.pub):
            try:
                sock.close(linger=0)
            except Exception:
                pass


def _endpoint(bind: str, port: int) -> str:
    host = f"[{bind}]" if ":" in bind and not bind.startswith("[") else bind
    return f"tcp://{host}:{port}"


def open_sockets(bind: str = "127.0.0.1", port: int | None = None) -> AgentSockets:
    """Bind ROUTER on `port` and PUB on `port + 1`; with port None, a free pair is chosen."""
    if not is_loopback(bind):
        raise BindError(
            f"refusing to listen on {bind}: a non-loopback bind needs CURVE keys, which this agent "
            "has not been given. Keep the default bind='127.0.0.1' and reach the run over SSH "
            "(torchtop attach ssh://HOST), or configure CURVE keys (torchtop keys)"
        )
    ctx = zmq.Context.instance()
    attempts = [port] if port is not None else [random.randrange(*PORT_RANGE) for _ in range(50)]
    last_error: Exception | None = None
    for p in attempts:
        router = pub = None
        try:
            router = ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.MAXMSGSIZE, 1 << 20)  # requests are small; refuse floods
            router.setsockopt(zmq.SNDHWM, 1000)
            router.bind(_endpoint(bind, p))
            pub = ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.LINGER, 0)
            pub.setsockopt(zmq.SNDHWM, 1000)
            pub.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
            pub.bind(_endpoint(bind, p + 1))
            return AgentSockets(ctx, router, pub, bind, p)
        except zmq.ZMQError as exc:
            last_error = exc
            for sock in (router, pub):
                if sock is not None:
                    sock.close(linger=0)
    if port is not None:
        raise BindError(
            f"cannot listen on {bind}:{port} and {port + 1} ({last_error}); pass another port to "
            "torchtop.agent.start(port=...) or TORCHTOP_PORT, or leave it unset for a free one"
        )
    raise BindError(f"found no free port pair on {bind} ({last_error})")
