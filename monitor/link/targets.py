"""What the user typed as TARGET, turned into an endpoint: a pid, ipc://PATH, HOST:PORT or tcp://HOST:PORT.

An Endpoint carries the agent's two ZeroMQ addresses (requests, batch stream): `ipc://` Unix
sockets by default, TCP when the agent was asked for a port. `from_discovery` is the one way a
discovery entry (this machine's, or another's read over ssh and reached through a tunnel)
becomes an Endpoint, with the CURVE keys the entry gives. Pure apart from reading the discovery
files; no zmq, no textual.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from torchtop.contract import curve_keys, discovery
from torchtop.contract.discovery import AgentInfo
from torchtop.contract.net import tcp_address


class TargetError(Exception):
    """A target that names no reachable agent; the message says what to do."""


@dataclass(frozen=True)
class Endpoint:
    address: str  # the agent's request socket: ipc:///path or tcp://host:port
    pub_address: str  # its batch stream
    pid: int | None = None
    label: str = ""
    curve: curve_keys.ClientCurve | None = field(default=None, compare=False, repr=False)  # CURVE agent
    # what is wrong with the way there ("" while fine): an ssh tunnel being rebuilt
    link: Callable[[], str] | None = field(default=None, compare=False, repr=False)
    # made from this machine's discovery entry: a run restarted there may bring new keys (rediscover)
    local_entry: bool = field(default=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        for address in (self.address, self.pub_address):
            if not isinstance(address, str) or not address.startswith(("ipc://", "tcp://")):
                raise ValueError(
                    f"not a ZeroMQ address: {address!r} (Endpoint.tcp(host, port) makes a TCP one)"
                )

    @classmethod
    def tcp(cls, host: str, port: int, pid: int | None = None, label: str = "", **kw: Any) -> Endpoint:
        """An agent on TCP: requests on `port`, batches on `port + 1`."""
        return cls(tcp_address(host, port), tcp_address(host, port + 1), pid, label, **kw)

    def link_trouble(self) -> str:
        return self.link() if self.link is not None else ""

    @property
    def transport(self) -> Literal["ipc", "tcp"]:
        return "ipc" if self.address.startswith("ipc://") else "tcp"

    @property
    def host(self) -> str:
        """The TCP host ("" for ipc: this machine)."""
        match = _TCP.match(self.address)
        return match.group(1).strip("[]") if match else ""

    @property
    def port(self) -> int:
        """The TCP request port (0 for ipc)."""
        match = _TCP.match(self.address)
        return int(match.group(2)) if match else 0

    @property
    def ipv6(self) -> bool:
        return ":" in self.host

    def __str__(self) -> str:
        return self.label or self.address


MAX_TARGET_CHARS = 1024  # a target longer than this is a mistake (a pasted file?), not a host
# a host name (letters, digits, dots, dashes, underscores; never a leading dash: ssh would read an
# option), an IPv4 or a bracket-less IPv6 address
_HOST = re.compile(r"^(?:[A-Za-z0-9_][A-Za-z0-9._-]*|[0-9A-Fa-f:.]*:[0-9A-Fa-f:.%A-Za-z]*)$")


def check_host(host: str, target: str) -> str:
    """`host` when it is a host name or an IP address; TargetError saying so otherwise."""
    if not _HOST.match(host) or len(host) > 253:
        raise TargetError(
            f"bad host {host[:64]!r} in target {target[:80]!r}: a host name (letters, digits, '.', '-', "
            "'_'; not starting with '-') or an IP address"
        )
    return host


def check_target(target: str) -> str:
    """The target stripped; TargetError for one too long or holding control characters."""
    target = target.strip()
    if len(target) > MAX_TARGET_CHARS:
        raise TargetError(f"a target of {len(target)} characters: at most {MAX_TARGET_CHARS}")
    if not target.isprintable():
        raise TargetError(f"target {target[:80]!r} holds control characters")
    return target


_HOSTPORT = re.compile(r"^(?:tcp://)?(\[[^\]]+\]|[^:/\[\]]+):(\d{1,5})/?$")
_TCP = re.compile(r"^tcp://(\[[^\]]+\]|[^:/\[\]]+):(\d{1,5})$")
REQ_SUFFIX, PUB_SUFFIX = ".req", ".pub"


def agent_addresses(info: AgentInfo) -> tuple[str, str]:
    """(request, stream) addresses of a discovery entry, as seen on the agent's machine.
    Entries of older agents have only bind and port. ValueError when it names neither, or when a
    field of it is wrongly typed (`unusable`)."""
    if info.unusable is not None:
        raise ValueError(info.unusable)
    address, pub = info.address, info.pub_address
    if address is not None and pub is not None:
        if all(a.startswith("ipc://") or _TCP.match(a) for a in (address, pub)):
            return address, pub
        raise ValueError(f"unusable agent addresses {address!r}, {pub!r}")
    port = info.port
    if port is None or not 0 < port < 65535:
        raise ValueError("no agent address and no port")
    bind = info.bind or "127.0.0.1"
    host = "127.0.0.1" if bind in ("0.0.0.0", "*", "localhost") else ("::1" if bind == "::" else bind)
    return tcp_address(host, port), tcp_address(host, port + 1)


def agent_curve(info: AgentInfo) -> curve_keys.ClientCurve | None:
    """The keys that reach a CURVE agent: the client pair its (0600) discovery entry admits, else
    our own configured client key with the public key it publishes."""
    server_key = info.server_key
    if server_key is None or len(server_key) != curve_keys.Z85_KEY_LEN:
        return None
    public, secret = info.client_key, info.client_secret
    if public is not None and secret is not None and len(public) == len(secret) == curve_keys.Z85_KEY_LEN:
        return curve_keys.ClientCurve(server_key.encode(), public.encode(), secret.encode())
    try:
        return curve_keys.load_client(server_key)
    except curve_keys.KeyConfigError:
        return None  # no client key here: hello will time out, and says why


def from_discovery(
    info: AgentInfo,
    via: tuple[str, str] | None = None,
    label: str = "",
    link: Callable[[], str] | None = None,
) -> Endpoint:
    """The Endpoint of a discovery entry. `via`: the (request, stream) addresses that reach it
    from here when they are not its own (an ssh tunnel's local ends); `link`: the tunnel's health.
    An entry with a wrongly typed field (`unusable`) is refused in one line, as is one with no way in."""
    try:
        address, pub = agent_addresses(info)
    except ValueError as exc:
        raise TargetError(f"the discovery entry of pid {info.pid} is unusable ({exc})") from None
    pid = info.pid
    if not label:
        label = f"pid {pid} ({where(info)})"
    request, stream = via or (address, pub)
    return Endpoint(request, stream, pid, label, curve=agent_curve(info), link=link, local_entry=via is None)


def rediscover(endpoint: Endpoint) -> Endpoint | None:
    """The endpoint of the local agent listening now where `endpoint` points (a run restarted on
    the same port has new keys), labelled as before; None when there is none, or `endpoint` was
    not made from a local entry (keys given by hand, a tunnel: the entry is on the other machine)."""
    if not endpoint.local_entry:
        return None
    for info in discovery.list_agents():
        try:
            if agent_addresses(info) == (endpoint.address, endpoint.pub_address):
                return from_discovery(info, label=endpoint.label)
        except ValueError:
            continue
    return None


def where(info: AgentInfo) -> str:
    """How an entry's agent listens, in a few words: "ipc" or HOST:PORT."""
    try:
        address = agent_addresses(info)[0]
    except ValueError:
        return "?"
    return "ipc" if address.startswith("ipc://") else address.removeprefix("tcp://")


def listens(info: AgentInfo) -> str:
    """Where an agent listens, in a word or two: "port 29512", "ipc"."""
    return f"port {info.port}" if info.port else where(info)


def printable(line: str) -> str:
    """`line` as a terminal shows it safely: control characters escaped (a file's text never
    moves the cursor or rewrites the screen)."""
    return line if line.isprintable() else repr(line)[1:-1]


def describe(info: AgentInfo) -> str:
    argv = " ".join(info.argv or [])
    line = f"pid {info.pid}  {listens(info)}  rank {info.rank if info.rank is not None else 0}  {argv}"
    line = printable(line)
    return f"{line}  (unusable: {info.unusable})" if info.unusable else line


def parse(target: str) -> Endpoint:
    """Parse a TARGET string; pids are looked up in the discovery files, and so are the ipc
    paths and loopback ports of local agents (their entries hold the keys that reach them)."""
    target = check_target(target)
    if target.isdigit() and target.isascii():  # "²" is a digit to str.isdigit, not to int()
        if len(target) > 10:
            raise TargetError(f"no process has pid {target[:20]}…: a pid has at most 10 digits")
        pid = int(target)
        for info in discovery.list_agents():
            if info.pid == pid:
                return from_discovery(info)
        raise TargetError(
            f"no torchtop agent with pid {pid} on this machine (`torchtop ls` lists the running ones)"
        )
    if target.startswith("ipc://"):
        if not target.endswith(REQ_SUFFIX):
            raise TargetError(
                f"an ipc target names the agent's request socket (…{REQ_SUFFIX}), not {target!r}"
            )
        if len(target.removeprefix("ipc://").encode()) > discovery.IPC_PATH_MAX:
            raise TargetError(f"an ipc path has at most {discovery.IPC_PATH_MAX} bytes: {target[:80]!r}…")
        for info in discovery.list_agents():
            if info.address == target:
                return from_discovery(info)
        return Endpoint(target, target[: -len(REQ_SUFFIX)] + PUB_SUFFIX, None, target)
    match = _HOSTPORT.match(target)
    if match:
        host, port = check_host(match.group(1).strip("[]"), target), int(match.group(2))
        if not 0 < port < 65535:
            raise TargetError(f"port {port} is out of range in target {target!r}")
        label = f"{host}:{port}"
        if host == "localhost" or host == "::1" or host.startswith("127."):
            for info in discovery.list_agents():  # ours: its entry has the keys
                if info.port == port:
                    return from_discovery(info, label=label)
        return Endpoint.tcp(host, port, None, label)
    raise TargetError(
        f"unknown target {target!r}: use a pid, ipc://PATH, HOST:PORT, tcp://HOST:PORT or ssh://[user@]host[/pid]"
    )


def local_agents() -> list[AgentInfo]:
    return discovery.list_agents()


def no_agent_message() -> str:
    skipped = discovery.scan(clean=False)[1]
    odd = (
        f", skipped {len(skipped)} file(s) that are no agent's entry (`torchtop ls` says why)"
        if skipped
        else ""
    )
    return (
        f"no torchtop agent is running on this machine (looked in {discovery.runtime_dir()}{odd}); "
        "call torchtop.agent.start() in your training script, or try `torchtop demo`"
    )


def resolve_single(target: str | None) -> Endpoint:
    """One endpoint: the target given, or the only local agent; several local ones is an error."""
    if target:
        return parse(target)
    agents = local_agents()
    if not agents:
        raise TargetError(no_agent_message())
    if len(agents) > 1:
        pids = ", ".join(str(a.pid) for a in agents)
        raise TargetError(
            f"{len(agents)} agents are running (pids {pids}); name one, e.g. `torchtop report {agents[0].pid}`"
        )
    return from_discovery(agents[0])
