"""The agent's two ZeroMQ sockets: ROUTER for requests, XPUB for batches.

By default both are `ipc://` Unix sockets in the per-user 0700 runtime directory: file
permissions decide who connects, so no other user of the machine reaches them. TCP only when
asked (a port or a bind address): the request port and port + 1. TCP is always CURVE, so that
another local user who can reach 127.0.0.1 still completes no handshake: on loopback with an
ephemeral server key pair unless keys are configured; off loopback only with configured keys
(refused otherwise). Either way an ephemeral client key pair is made and admitted; it goes only
into the 0600 discovery file, which the same user's local monitors read. Both sockets are then
CURVE servers in a private context whose ZAP handler (zmq.auth) admits only those client keys
(plus the authorized_keys directory); anyone else's frames are never read.
"""

from __future__ import annotations

import ipaddress
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import zmq

from torchtop.contract import curve_keys, discovery
from torchtop.contract.net import tcp_address
from torchtop.contract.private import NotPrivate, check_private_dir, fits_socket, short_private_tempdir

PORT_RANGE = (20000, 60000)
ZAP_DOMAIN = "torchtop"
SOCKET_NAME_MAX = len("agent-4194304.req")  # the longest pid Linux gives


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
    address: str  # where monitors connect for requests: ipc:///... or tcp://host:port
    pub_address: str  # ... and for the batch stream
    bind: str | None = None  # the TCP bind host; None on ipc
    port: int = 0  # the TCP request port (batches on port + 1); 0 on ipc
    curve: curve_keys.ServerCurve | None = None
    client: tuple[bytes, bytes] | None = None  # the ephemeral client (public, secret) admitted
    auth: Any = None  # the zmq.auth ThreadAuthenticator when CURVE is on
    files: list[Path] = field(default_factory=list)  # ipc socket files, removed on close
    owner: int = field(default_factory=os.getpid)  # a forked child never removes the parent's files
    _trims: list[float] = field(default_factory=list)  # when to give memory back after renew_router

    @property
    def transport(self) -> Literal["ipc", "tcp"]:
        return "tcp" if self.port else "ipc"

    @property
    def pub_port(self) -> int:
        return self.port + 1 if self.port else 0

    def renew_router(self, wait_s: float = 0.05) -> None:
        """Replace the ROUTER with a fresh one on the same address: what the old one held (a
        frame bomb, whole) is freed with it; peers reconnect by themselves. Its listener goes
        first (unbind): a ZeroMQ that removes an ipc socket's file then does it from its I/O
        thread, and the new one is bound after that (else the late unlink would take the new
        file); libzmq 4.3.5 removes none, and binding replaces the old file."""
        old = self.router
        path = Path(self.address.removeprefix("ipc://")) if self.transport == "ipc" else None
        old_inode = _inode(path)
        try:
            old.unbind(self.address if path is not None else old.getsockopt_string(zmq.LAST_ENDPOINT))
        except zmq.ZMQError:
            pass
        deadline = time.monotonic() + wait_s
        while path is not None and _inode(path) == old_inode and time.monotonic() < deadline:
            time.sleep(0.002)
        old.close(linger=0)
        address = self.address if path is not None else tcp_address(self.bind or "", self.port)
        while True:
            router = _new_router(self.ctx, self.curve, ":" in (self.bind or ""))
            try:
                router.bind(address)
                break
            except zmq.ZMQError:  # a TCP port frees a moment after its listener closes
                router.close(linger=0)
                if time.monotonic() >= deadline + wait_s:
                    raise
                time.sleep(0.005)
        if path is not None:
            try:
                os.chmod(path, 0o600)
            except OSError:
                pass
        self.router = router
        now = time.monotonic()
        self._trims = [now + 0.2, now + 1.0, now + 3.0]  # the old socket's queue is freed by ZeroMQ's threads

    def maybe_trim(self, now: float) -> None:
        """After a renewal, give the freed memory back (a few times: ZeroMQ frees it meanwhile)."""
        if self._trims and now >= self._trims[0]:
            self._trims.pop(0)
            release_freed_memory()

    def close(self) -> None:
        """Close both sockets and end the private context: the ports are free when this returns."""
        for sock in (self.router, self.pub):
            try:
                sock.close(linger=0)
            except Exception:  # broad: best-effort cleanup
                pass
        _stop_private(self.ctx, self.auth)
        for path in self.files if os.getpid() == self.owner else []:
            try:
                path.unlink()
            except OSError:
                pass


def _inode(path: Path | None) -> int | None:
    try:
        return path.stat().st_ino if path is not None else None
    except OSError:
        return None


def release_freed_memory() -> None:
    """Give the heap's free pages back to the system (glibc's malloc_trim): a freed frame bomb's
    ~64 bytes a frame would otherwise stay in the process's RSS."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except Exception:  # broad: not glibc, or no ctypes: nothing to do
        pass  # not glibc: nothing to do


def connect_host(bind: str) -> str:
    """Where a monitor on this machine connects to reach a bind address."""
    if bind in ("0.0.0.0", "*", "localhost"):
        return "127.0.0.1"
    if bind == "::":
        return "::1"
    return bind


def _server_curve(bind: str) -> curve_keys.ServerCurve:
    if curve_keys.curve_wanted(is_loopback(bind)):  # configured keys: off loopback, or asked for
        try:
            return curve_keys.load_server(bind)
        except curve_keys.KeyConfigError as exc:
            raise BindError(f"refusing to listen on {bind} without CURVE: {exc}") from None
    public, secret = zmq.curve_keypair()  # loopback: a key pair for this run only
    return curve_keys.ServerCurve(public, secret, curve_keys.authorized_dir())


class _Admitted:
    """zmq.auth's credentials provider: the client keys the agent admits (z85)."""

    def __init__(self, allowed: set[bytes]) -> None:
        self.allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.allowed


def _start_auth(ctx: Any, curve: curve_keys.ServerCurve, client_public: bytes) -> Any:
    import zmq.auth
    from zmq.auth.thread import ThreadAuthenticator

    allowed = {client_public}
    if curve.authorized.is_dir():
        allowed |= set(zmq.auth.load_certificates(str(curve.authorized)))
    auth = ThreadAuthenticator(ctx)
    auth.start()  # the ZAP handler is bound before any socket listens
    auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=_Admitted(allowed))
    return auth


def _stop_private(ctx: Any, auth: Any) -> None:
    try:
        if auth is not None:
            auth.stop()
        ctx.term()  # every socket of it is closed (linger 0): returns once they are gone
    except Exception:  # broad: best-effort cleanup
        pass


def _secure(sock: Any, curve: curve_keys.ServerCurve | None) -> None:
    if curve is not None:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())


def _new_router(ctx: Any, curve: curve_keys.ServerCurve | None, ipv6: bool) -> Any:
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.IPV6, int(ipv6))
    router.setsockopt(zmq.MAXMSGSIZE, 1 << 20)  # requests are small; refuse floods
    router.setsockopt(zmq.RCVHWM, 4)  # per peer: a monitor waits for each answer
    router.setsockopt(zmq.SNDHWM, 16)  # per peer: replies (snapshots ~2 MB) to one not reading
    _secure(router, curve)
    return router


def _bind_pair(
    ctx: Any, request: str, stream: str, curve: curve_keys.ServerCurve | None, ipv6: bool = False
) -> tuple[Any, Any]:
    """ROUTER on `request`, XPUB on `stream`; zmq.ZMQError (nothing left open) when either fails."""
    router = pub = None
    try:
        router = _new_router(ctx, curve, ipv6)
        router.bind(request)
        # XPUB: a PUB that hears (un)subscriptions, so the agent knows when anyone listens
        pub = ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.IPV6, int(ipv6))
        pub.setsockopt(zmq.SNDHWM, 1000)
        pub.setsockopt(zmq.RCVHWM, 100)
        pub.setsockopt(zmq.MAXMSGSIZE, 1 << 16)  # inbound: subscriptions (and the CURVE handshake)
        _secure(pub, curve)
        pub.bind(stream)
        return router, pub
    except zmq.ZMQError:
        for sock in (router, pub):
            if sock is not None:
                sock.close(linger=0)
        raise


def open_sockets(bind: str = "127.0.0.1", port: int | None = None) -> AgentSockets:
    """TCP: bind ROUTER on `port` and XPUB on `port + 1`; with port None (or 0), a free pair.

    Always CURVE (see the module's docstring); off loopback without configured keys: BindError
    saying what to run.
    """
    curve = _server_curve(bind)
    client_public, client_secret = zmq.curve_keypair()
    # A private context, never the process's shared one: the user's code may term that, and
    # closing a socket of a shared context frees its port only later, so a start() right after
    # stop() on the same port would fail. Ours is termed on close, which waits for the ports.
    ctx = zmq.Context()
    auth = _start_auth(ctx, curve, client_public)
    ipv6 = ":" in bind  # zmq sockets are IPv4-only unless told otherwise: "::1" needs it
    attempts = [port] if port else [random.randrange(*PORT_RANGE) for _ in range(50)]
    last_error: Exception | None = None
    for p in attempts:
        try:
            router, pub = _bind_pair(ctx, tcp_address(bind, p), tcp_address(bind, p + 1), curve, ipv6)
        except zmq.ZMQError as exc:
            last_error = exc
            continue
        host = connect_host(bind)
        return AgentSockets(
            ctx,
            router,
            pub,
            tcp_address(host, p),
            tcp_address(host, p + 1),
            bind,
            p,
            curve,
            (client_public, client_secret),
            auth,
        )
    _stop_private(ctx, auth)
    if port:
        raise BindError(
            f"cannot listen on {bind}:{port} and {port + 1} ({last_error}); pass another port to "
            "torchtop.agent.start(port=...) or TORCHTOP_PORT, or leave it unset for a free one"
        )
    raise BindError(f"found no free port pair on {bind} ({last_error})")


def socket_dir() -> Path:
    """Where the ipc sockets go: the runtime directory when it is ours and its path is short
    enough for a Unix socket; else /tmp/torchtop-<uid> on the same terms; else a fresh 0700
    directory (never an abstract socket: any user of the machine can reach those)."""
    uid = os.geteuid() if hasattr(os, "geteuid") else 0
    for candidate in (discovery.runtime_dir(), Path("/tmp") / f"torchtop-{uid}"):
        if not fits_socket(candidate, SOCKET_NAME_MAX):
            continue
        try:
            check_private_dir(candidate, narrow=True)
            return candidate
        except (NotPrivate, OSError):
            continue
    return short_private_tempdir("torchtop-")


def open_ipc(directory: Path, pid: int) -> AgentSockets:
    """ipc: ROUTER on <directory>/agent-<pid>.req, XPUB on <directory>/agent-<pid>.pub.

    `directory` is private (socket_dir()); the socket files are made 0600 as well. A stale file
    of a dead process with our pid is replaced (ZeroMQ unlinks it before binding).
    """
    files = [directory / f"agent-{pid}.req", directory / f"agent-{pid}.pub"]
    request, stream = (f"ipc://{path}" for path in files)
    ctx = zmq.Context()
    try:
        router, pub = _bind_pair(ctx, request, stream, None)
    except zmq.ZMQError as exc:
        _stop_private(ctx, None)
        raise BindError(
            f"cannot listen on {request} ({exc}); set TORCHTOP_RUNTIME_DIR to a directory of yours"
        ) from None
    for path in files:
        try:
            os.chmod(path, 0o600)  # in our 0700 directory: nobody else could have swapped it
        except OSError:
            pass
    return AgentSockets(ctx, router, pub, request, stream, files=files)
