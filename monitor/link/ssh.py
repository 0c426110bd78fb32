"""Reach an agent on another machine through the system `ssh`: the recommended way.

`ssh://[user@]host[:sshport][/pid-or-port]`. The user's own ssh (config, agent, keys, jump hosts)
does the work; we add `-o BatchMode=yes` (never prompt inside a TUI) and, for the tunnel,
`-o ExitOnForwardFailure=yes`. `torchtop ls --json` runs on the host to find the agent (its
discovery entry: addresses, and CURVE keys for a TCP agent). An agent on ipc:// sockets (the
default) is reached by forwarding two local Unix sockets, in a private 0700 directory removed on
close, to its two (`ssh -N -L /local/req:/remote/req ...`, OpenSSH stream-local forwarding); an
agent on TCP by forwarding two free local ports (`-L lp:127.0.0.1:rp -L lp+1:127.0.0.1:rp+1`).
The monitor then talks to the local ends as if the agent were local. A tunnel that dies while
in use is rebuilt on the same local ends, so the monitor's ZeroMQ sockets reconnect by themselves.

Extra ssh options: $TORCHTOP_SSH_OPTS (shell words, e.g. "-F ~/.ssh/lab_config") and `--ssh-option`
(each becomes `-o OPTION`). The remote command is $TORCHTOP_REMOTE_CMD (default `torchtop`), e.g.
`~/venv/bin/torchtop` when torchtop is not on the PATH of a non-interactive ssh shell.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from torchtop.contract.discovery import AgentInfo, entry
from torchtop.contract.net import url_host
from torchtop.contract.private import short_private_tempdir
from torchtop.monitor.link.targets import (
    Endpoint,
    TargetError,
    agent_addresses,
    check_host,
    check_target,
    describe,
    from_discovery,
)
from torchtop.monitor.link.tunnel_process import TUNNEL_TIMEOUT_S, Keeper, launch, stop, wait_up

ENV_OPTS = "TORCHTOP_SSH_OPTS"
ENV_REMOTE_CMD = "TORCHTOP_REMOTE_CMD"
LIST_TIMEOUT_S = 30.0
_USER = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")  # never a leading '-': ssh would read an option


class SshError(TargetError):
    """ssh could not reach the host, list its agents or forward the ports; says what to do."""

    not_installed = False


@dataclass(frozen=True)
class SshTarget:
    host: str
    user: str | None = None
    port: int | None = None  # the ssh port
    select: int | None = None  # a pid or an agent port on the host

    @property
    def destination(self) -> str:
        return f"{self.user}@{self.host}" if self.user else self.host

    def __str__(self) -> str:
        port = f":{self.port}" if self.port else ""
        return f"ssh://{self.user + '@' if self.user else ''}{url_host(self.host)}{port}"


def is_ssh(target: str | None) -> bool:
    return bool(target) and target.strip().lower().startswith("ssh://")  # type: ignore[union-attr]


def parse(target: str) -> SshTarget:
    """`ssh://[user@]host[:sshport][/pid-or-port]` → SshTarget; TargetError when malformed, and
    for a host or user that ssh could read as an option (a leading '-')."""
    target = check_target(target)
    try:
        parts = urlsplit(target)
        host, user, port = parts.hostname, parts.username, parts.port
    except ValueError as exc:
        raise SshError(
            f"bad ssh target {target!r} ({exc}): use ssh://[user@]host[:sshport][/pid-or-port]"
        ) from None
    if parts.scheme.lower() != "ssh" or not host:
        raise SshError(f"bad ssh target {target!r}: use ssh://[user@]host[:sshport][/pid-or-port]")
    check_host(host, target)
    if user is not None and not _USER.match(user):
        raise SshError(
            f"bad user {user[:64]!r} in ssh target {target[:80]!r}: letters, digits, '.', '-', '_' "
            "(not starting with '-')"
        )
    path = parts.path.strip("/")
    if path and not (path.isdigit() and path.isascii() and len(path) <= 10):
        raise SshError(
            f"bad ssh target {target!r}: after the host comes a pid or an agent port, e.g. ssh://{host}/12345"
        )
    return SshTarget(host, user or None, port, int(path) if path else None)


def ssh_base(target: SshTarget, options: Sequence[str] = ()) -> list[str]:
    """The ssh command line up to (not including) the destination."""
    ssh = shutil.which("ssh")
    if ssh is None:
        raise SshError("no `ssh` on the PATH: install the OpenSSH client")
    cmd = [ssh, "-o", "BatchMode=yes"]
    cmd += shlex.split(os.environ.get(ENV_OPTS, ""))
    for opt in options:
        cmd += ["-o", opt]
    if target.port:
        cmd += ["-p", str(target.port)]
    return cmd


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def remote_agents(target: SshTarget, options: Sequence[str] = ()) -> list[AgentInfo]:
    """The agents running on the host, from `torchtop ls --json` run there."""
    remote = os.environ.get(ENV_REMOTE_CMD) or "torchtop"
    cmd = [
        *ssh_base(target, options),
        "--",
        target.destination,
        f"{remote} ls --json",
    ]  # "--": no option after
    try:
        proc = subprocess.run(
            cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=LIST_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        raise SshError(f"ssh {target.destination} did not answer within {LIST_TIMEOUT_S:g}s") from None
    if proc.returncode == 255:
        raise SshError(
            f"ssh to {target.destination} failed: {_last_line(proc.stderr) or 'exit 255'} "
            "(check that `ssh " + target.destination + " true` works without a prompt)"
        )
    if proc.returncode in (126, 127) or "command not found" in proc.stderr or "No such file" in proc.stderr:
        error = SshError(
            f"`{remote}` is not installed on {target.host} (or not on the PATH of a non-interactive ssh "
            f"shell): pip install torchtop there, or set {ENV_REMOTE_CMD} to its path, e.g. "
            f"{ENV_REMOTE_CMD}=~/venv/bin/torchtop"
        )
        error.not_installed = True
        raise error
    if proc.returncode != 0:
        raise SshError(
            f"`{remote} ls --json` failed on {target.host} (exit {proc.returncode}): {_last_line(proc.stderr)}"
        )
    try:
        agents = json.loads(_last_line(proc.stdout) or "[]")
    except ValueError:
        agents = None
    if not isinstance(agents, list) or not all(
        isinstance(a, dict) and ("port" in a or "address" in a) for a in agents
    ):
        raise SshError(
            f"`{remote} ls --json` on {target.host} printed no agent list: {_last_line(proc.stdout)!r}"
        )
    return [entry(a) for a in agents]


def choose(target: SshTarget, agents: list[AgentInfo]) -> AgentInfo:
    """The agent the target names (a pid, else a port), or the only one."""
    if target.select is not None:
        for key in ("pid", "port"):
            for info in agents:
                if getattr(info, key) == target.select:
                    return info
        listing = "; ".join(describe(a) for a in agents) or "none are running"
        raise SshError(f"no torchtop agent with pid or port {target.select} on {target.host} ({listing})")
    if not agents:
        raise SshError(f"no torchtop agent is running on {target.host} (as {target.user or 'your ssh user'})")
    if len(agents) > 1:
        pids = ", ".join(str(a.pid) for a in agents)
        raise SshError(
            f"{len(agents)} agents are running on {target.host} (pids {pids}); name one, e.g. {target}/{agents[0].pid}"
        )
    return agents[0]


def _free_port_pair() -> int:
    """A local port p with p and p + 1 both free right now."""
    for _ in range(100):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise SshError("found no two free adjacent local ports for the ssh tunnel")


def _tcp_forward(remote: str) -> tuple[str, str]:
    """`-L` spec parts for a remote tcp://host:port: (host, port), the host bracketed for IPv6."""
    host, port = remote.removeprefix("tcp://").rsplit(":", 1)
    return url_host(host.strip("[]")), port


def _forwards(remote: tuple[str, str], sock_dir: Path | None) -> tuple[list[str], tuple[str, str]]:
    """The ssh -L arguments that reach the agent's two remote addresses, and the local ends."""
    if sock_dir is not None:  # ipc: Unix socket to Unix socket
        local = (sock_dir / "req", sock_dir / "pub")
        args = []
        for here, there in zip(local, remote):
            args += ["-L", f"{here}:{there.removeprefix('ipc://')}"]
        return args, (f"ipc://{local[0]}", f"ipc://{local[1]}")
    lport = _free_port_pair()
    args = []
    for port, there in zip((lport, lport + 1), remote):
        host, rport = _tcp_forward(there)
        args += ["-L", f"{port}:{host}:{rport}"]
    return args, (f"tcp://127.0.0.1:{lport}", f"tcp://127.0.0.1:{lport + 1}")


def _label(target: SshTarget, info: AgentInfo, remote: str, local: str) -> str:
    pid = info.pid
    if remote.startswith("ipc://"):
        return f"{target}/{pid} (pid {pid}, its sockets via {Path(local.removeprefix('ipc://')).parent})"
    rport = remote.rsplit(":", 1)[1]
    return (
        f"{target}/{pid or rport} ("
        + (f"pid {pid}, " if pid else "")
        + f"port {rport} via {local.removeprefix('tcp://')})"
    )


@contextmanager
def tunnel(target: SshTarget, info: AgentInfo, options: Sequence[str] = ()) -> Iterator[Endpoint]:
    """Forward local ends to the agent's two sockets on the host; an Endpoint while it lasts.
    A tunnel that dies meanwhile is rebuilt on the same local ends (`Keeper`, tunnel_process.py)."""
    try:
        remote = agent_addresses(info)
    except ValueError as exc:
        raise SshError(f"the agent listing from {target.host} is unusable ({exc})") from None
    ipc = remote[0].startswith("ipc://")
    sock_dir = short_private_tempdir("torchtop-ssh-") if ipc else None  # 0700, ours: no one else connects
    try:
        with _open_tunnel(target, info, remote, sock_dir, options) as endpoint:
            yield endpoint
    finally:
        if sock_dir is not None:
            shutil.rmtree(sock_dir, ignore_errors=True)


@contextmanager
def _open_tunnel(
    target: SshTarget,
    info: AgentInfo,
    remote: tuple[str, str],
    sock_dir: Path | None,
    options: Sequence[str],
) -> Iterator[Endpoint]:
    last_error = ""
    for _attempt in range(3):  # a local port may be taken between choosing and ssh binding it
        forwards, local = _forwards(remote, sock_dir)
        cmd = [
            *ssh_base(target, options),
            "-N",
            "-o",
            "ExitOnForwardFailure=yes",
            "-o",
            "ServerAliveInterval=15",
            "-o",
            "ServerAliveCountMax=2",
            # a rebuilt tunnel binds the same local socket paths the dead ssh left behind
            *(["-o", "StreamLocalBindUnlink=yes"] if sock_dir is not None else []),
            *forwards,
            "--",  # the destination is never read as an option
            target.destination,
        ]
        with tempfile.TemporaryFile() as err:
            proc = launch(cmd, err)
            try:
                up = wait_up(proc, local, TUNNEL_TIMEOUT_S)
                if not up and proc.poll() is None:
                    raise SshError(
                        f"the ssh tunnel to {target.destination} was not up within {TUNNEL_TIMEOUT_S:g}s"
                    )
                if not up:
                    err.seek(0)
                    last_error = _last_line(err.read().decode(errors="replace")) or f"exit {proc.returncode}"
                    if "forward" in last_error.lower() and _attempt < 2:
                        continue
                    raise SshError(f"ssh tunnel to {target.destination} failed: {last_error}")
            except BaseException:  # broad: stops ssh on any exit (Ctrl-C too), then re-raises
                stop(proc)
                raise
        keeper = Keeper(cmd, proc, local, target.destination)
        try:
            label = _label(target, info, remote[0], local[0])
            yield from_discovery(info, via=local, label=label, link=keeper.trouble)
        finally:
            keeper.close()
        return
    raise SshError(f"ssh tunnel to {target.destination} failed: {last_error}")


@contextmanager
def open_ssh(target: str, options: Sequence[str] = ()) -> Iterator[Endpoint]:
    """Resolve an ssh:// target to one agent and keep a tunnel to it open while in use."""
    parsed = parse(target)
    try:
        info = choose(parsed, remote_agents(parsed, options))
    except SshError as exc:
        # no torchtop command there, but the user named a port: tunnel to it (hello will tell)
        if not (exc.not_installed and parsed.select is not None and 0 < parsed.select < 65535):
            raise
        info = AgentInfo(port=parsed.select)  # an older agent's entry: TCP on loopback
    with tunnel(parsed, info, options) as endpoint:
        yield endpoint
