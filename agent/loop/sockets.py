"""The agent's two ZeroMQ sockets: ROUTER for requests on `port`, XPUB for batches on `port + 1`.

Loopback by default. A non-loopback bind needs CURVE (agent/keys.py) and is refused without it:
a training process must not take orders from whoever can reach its port. With CURVE both sockets
are CURVE servers in a private context whose ZAP handler (zmq.auth) admits only the authorized
client keys; anyone else completes no handshake, so nothing they send is ever read.
"""

from __future__ import annotations

import ipaddress
import random
from dataclasses import dataclass
from typing import Any

import zmq

from torchtop.agent.contract import keys

PORT_RANGE = (20000, 60000)
ZAP_DOMAIN = "torchtop"


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
    curve: keys.ServerCurve | None = None
    auth: Any = None  # the zmq.auth ThreadAuthenticator when CURVE is on

    @property
    def pub_port(self) -> int:
        return self.port + 1

    def close(self) -> None:
        """Close both sockets and end the private context: the ports are free when this returns."""
        for sock in (self.router, self.pub):
            try:
                sock.close(linger=0)
            except Exception:
                pass
        _stop_private(self.ctx, self.auth)


def _endpoint(bind: str, port: int) -> str:
    host = f"[{bind}]" if ":" in bind and not bind.startswith("[") else bind
    return f"tcp://{host}:{port}"


def _server_curve(bind: str) -> keys.ServerCurve | None:
    if not keys.curve_wanted(is_loopback(bind)):
        return None
    try:
        return keys.load_server(bind)
    except keys.KeyConfigError as exc:
        raise BindError(f"refusing to listen on {bind} without CURVE: {exc}") from None


def _start_auth(ctx: Any, curve: keys.ServerCurve) -> Any:
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx)
    auth.start()  # the ZAP handler is bound before any socket listens
    auth.configure_curve(domain=ZAP_DOMAIN, location=str(curve.authorized))
    return auth


def _stop_private(ctx: Any, auth: Any) -> None:
    try:
        if auth is not None:
            auth.stop()
        ctx.term()  # every socket of it is closed (linger 0): returns once they are gone
    except Exception:
        pass


def _secure(sock: Any, curve: keys.ServerCurve | None) -> None:
    if curve is not None:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())


def open_sockets(bind: str = "127.0.0.1", port: int | None = None) -> AgentSockets:
    """Bind ROUTER on `port` and XPUB on `port + 1`; with port None, a free pair is chosen.

    CURVE is on off loopback (refused with what to run when keys are missing) and on loopback
    when $TORCHTOP_SERVER_KEY or $TORCHTOP_CURVE=1 asks for it.
    """
    curve = _server_curve(bind)
    # A private context, never the process's shared one: the user's code may term that, and
    # closing a socket of a shared context frees its port only later, so a start() right after
    # stop() on the same port would fail. Ours is termed on close, which waits for the ports.
    ctx = zmq.Context()
    auth = _start_auth(ctx, curve) if curve is not None else None
    ipv6 = int(":" in bind)  # zmq sockets are IPv4-only unless told otherwise: "::1" needs it
    attempts = [port] if port is not None else [random.randrange(*PORT_RANGE) for _ in range(50)]
    last_error: Exception | None = None
    for p in attempts:
        router = pub = None
        try:
            router = ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.IPV6, ipv6)
            router.setsockopt(zmq.MAXMSGSIZE, 1 << 16)  # requests are small; refuse floods
            router.setsockopt(zmq.RCVHWM, 4)  # per peer: a monitor waits for each answer
            router.setsockopt(zmq.SNDHWM, 16)  # per peer: replies (snapshots ~2 MB) to one not reading
            _secure(router, curve)
            router.bind(_endpoint(bind, p))
            # XPUB: a PUB that hears (un)subscriptions, so the agent knows when anyone listens
            pub = ctx.socket(zmq.XPUB)
            pub.setsockopt(zmq.LINGER, 0)
            pub.setsockopt(zmq.IPV6, ipv6)
            pub.setsockopt(zmq.SNDHWM, 1000)
            pub.setsockopt(zmq.RCVHWM, 100)
            pub.setsockopt(zmq.MAXMSGSIZE, 1 << 16)  # inbound: subscriptions (and the CURVE handshake)
            _secure(pub, curve)
            pub.bind(_endpoint(bind, p + 1))
            return AgentSockets(ctx, router, pub, bind, p, curve, auth)
        except zmq.ZMQError as exc:
            last_error = exc
            for sock in (router, pub):
                if sock is not None:
                    sock.close(linger=0)
    _stop_private(ctx, auth)
    if port is not None:
        raise BindError(
            f"cannot listen on {bind}:{port} and {port + 1} ({last_error}); pass another port to "
            "torchtop.agent.start(port=...) or TORCHTOP_PORT, or leave it unset for a free one"
        )
    raise BindError(f"found no free port pair on {bind} ({last_error})")
