"""What the user typed as TARGET, turned into an endpoint: a pid, HOST:PORT or tcp://HOST:PORT.

Pure apart from reading the discovery files; no zmq, no textual.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torchtop.agent.contract import discovery, keys


class TargetError(Exception):
    """A target that names no reachable agent; the message says what to do."""


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int  # the agent's request port; batches come on port + 1
    pid: int | None = None
    label: str = ""
    curve: keys.ClientCurve | None = field(default=None, compare=False, repr=False)  # CURVE agent
    # what is wrong with the way there ("" while fine): an ssh tunnel being rebuilt
    link: Callable[[], str] | None = field(default=None, compare=False, repr=False)

    def link_trouble(self) -> str:
        return self.link() if self.link is not None else ""

    def address(self, port: int | None = None) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port if port is None else port}"

    @property
    def pub_address(self) -> str:
        return self.address(self.port + 1)

    def __str__(self) -> str:
        return self.label or f"{self.host}:{self.port}"


_HOSTPORT = re.compile(r"^(?:tcp://)?(\[[^\]]+\]|[^:/\[\]]+):(\d{1,5})/?$")


def from_discovery(info: dict[str, Any]) -> Endpoint:
    bind = info.get("bind") or "127.0.0.1"
    host = "127.0.0.1" if bind in ("0.0.0.0", "*") else ("::1" if bind == "::" else bind)
    label = f"pid {info['pid']} ({host}:{info['port']})"
    return Endpoint(host, int(info["port"]), int(info["pid"]), label, curve=local_curve(info))


def local_curve(info: dict[str, Any]) -> keys.ClientCurve | None:
    """A CURVE agent publishes its public key in its discovery file: use it with our client key."""
    server_key = info.get("server_key")
    if not isinstance(server_key, str) or len(server_key) != keys.Z85_KEY_LEN:
        return None
    try:
        return keys.load_client(server_key)
    except keys.KeyConfigError:
        return None  # no client key here: hello will time out, and says why


def describe(info: dict[str, Any]) -> str:
    argv = " ".join(info.get("argv") or [])
    return f"pid {info.get('pid')}  port {info.get('port')}  rank {info.get('rank', 0)}  {argv}"


def parse(target: str) -> Endpoint:
    """Parse a TARGET string; pids are looked up in the discovery files."""
    target = target.strip()
    if target.isdigit():
        pid = int(target)
        for info in discovery.list_agents():
            if info.get("pid") == pid:
                return from_discovery(info)
        raise TargetError(
            f"no torchtop agent with pid {pid} on this machine (`torchtop ls` lists the running ones)"
        )
    match = _HOSTPORT.match(target)
    if match:
        host, port = match.group(1).strip("[]"), int(match.group(2))
        if not 0 < port < 65535:
            raise TargetError(f"port {port} is out of range in target {target!r}")
        return Endpoint(host, port, None, f"{host}:{port}")
    raise TargetError(
        f"unknown target {target!r}: use a pid, HOST:PORT, tcp://HOST:PORT or ssh://[user@]host[/pid]"
    )


def local_agents() -> list[dict[str, Any]]:
    return discovery.list_agents()


def no_agent_message() -> str:
    return (
        f"no torchtop agent is running on this machine (looked in {discovery.runtime_dir()}); "
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
        pids = ", ".join(str(a["pid"]) for a in agents)
        raise TargetError(
            f"{len(agents)} agents are running (pids {pids}); name one, e.g. `torchtop report {agents[0]['pid']}`"
        )
    return from_discovery(agents[0])
