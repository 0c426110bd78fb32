"""`ssh://` targets against a real sshd on loopback that the test starts (skipped when it cannot).

A throwaway host key and user key live in tmp_path; the monitor's ssh gets them through an ssh
config file passed with TORCHTOP_SSH_OPTS="-F ...", the same way a user would pass their own.
The "remote" torchtop is this venv's, pointed at the test's runtime dir via TORCHTOP_REMOTE_CMD.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from remote_util import loopback_sshd, training_agent

from tests.agent_util import free_port, free_port_pair
from torchtop.monitor.commands import keys as keys_cli
from torchtop.monitor.link import ssh
from torchtop.monitor.link.client import AgentClient
from torchtop.monitor.link.targets import Endpoint, TargetError

pytestmark = pytest.mark.slow  # a real sshd and ssh subprocesses

SSHD = shutil.which("sshd") or next(
    (p for p in ("/usr/sbin/sshd", "/usr/local/sbin/sshd") if os.path.exists(p)), None
)


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory):
    """A private sshd on 127.0.0.1 that accepts one throwaway key for the current user."""
    with loopback_sshd(tmp_path_factory.mktemp("sshd")) as found:
        if isinstance(found, str):
            pytest.skip(found)
        yield found


@pytest.fixture
def ssh_env(
    sshd, runtime_dir: Path, subprocess_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> dict[str, str]:
    """Env (here and for child CLIs) so that ssh uses the test's key and 'remote' torchtop this venv."""
    remote = f"env TORCHTOP_RUNTIME_DIR={shlex.quote(str(runtime_dir))} {shlex.quote(sys.executable)} -m torchtop.monitor.commands.cli"
    extra = {ssh.ENV_OPTS: sshd["opts"], ssh.ENV_REMOTE_CMD: remote}
    for key, value in extra.items():
        monkeypatch.setenv(key, value)
    return {**subprocess_env, **extra}


def torchtop(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torchtop.monitor.commands.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.3).close()
        return True
    except OSError:
        return False


def _local_ends(endpoint: Endpoint) -> list[str]:
    """What the tunnel's ssh names as its local ends: socket paths (ipc) or ports (tcp)."""
    if endpoint.transport == "ipc":
        return [a.removeprefix("ipc://") for a in (endpoint.address, endpoint.pub_address)]
    return [a.rsplit(":", 1)[1] for a in (endpoint.address, endpoint.pub_address)]


def _closed(endpoint: Endpoint) -> bool:
    """Nothing is left of the tunnel's local ends: the ports refuse, the socket directory is gone."""
    if endpoint.transport == "ipc":
        return not Path(endpoint.address.removeprefix("ipc://")).parent.exists()
    return not _accepts(endpoint.port) and not _accepts(int(endpoint.pub_address.rsplit(":", 1)[1]))


# -- parsing (no sshd) ---------------------------------------------------------------------------
def test_parse_ssh_targets() -> None:
    assert ssh.parse("ssh://gpu1") == ssh.SshTarget("gpu1")
    assert ssh.parse("ssh://me@gpu1:2222/4242") == ssh.SshTarget("gpu1", "me", 2222, 4242)
    assert ssh.parse("ssh://[::1]:22/7").host == "::1"
    assert str(ssh.parse("ssh://me@gpu1:2222/1")) == "ssh://me@gpu1:2222"
    assert ssh.is_ssh("SSH://x") and not ssh.is_ssh("tcp://x:1") and not ssh.is_ssh(None)
    for bad in ("ssh://", "ssh://host/abc", "ssh://host:notaport"):
        with pytest.raises(TargetError, match="ssh://"):
            ssh.parse(bad)


# -- against the real sshd -----------------------------------------------------------------------
def test_report_ls_and_capture_over_ssh(ssh_env: dict[str, str], sshd, tmp_path: Path) -> None:
    env = {**ssh_env, "TORCHTOP_DIR": str(tmp_path / "captures")}
    # trains until stopped: the default 120 s could run out before a loaded machine's six commands over ssh
    with training_agent(tmp_path, env, seconds=600) as (proc, info):
        host = sshd["host"]
        out = torchtop(ssh_env, "ls", host, "--json")
        assert out.returncode == 0, out.stderr
        assert [a["pid"] for a in json.loads(out.stdout)] == [proc.pid]
        out = torchtop(ssh_env, "ls", host)
        assert out.returncode == 0 and f"pid {proc.pid}" in out.stdout

        out = torchtop(ssh_env, "report", f"{host}/{proc.pid}", "--seconds", "2")
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        assert report["steps"] > 0 and report["pid"] == proc.pid and report["target"].startswith(host)
        assert info.transport == "ipc"  # the default: its Unix sockets are forwarded
        local_dir = Path(report["target"].rsplit(" via ", 1)[1].rstrip(")"))
        assert local_dir.name.startswith("torchtop-ssh-") and not local_dir.exists()  # gone with the command

        # with no pid at all (the only agent there)
        for target in (host,):
            out = torchtop(ssh_env, "report", target, "--seconds", "1")
            assert out.returncode == 0 and json.loads(out.stdout)["pid"] == proc.pid, out.stderr

        out = torchtop(ssh_env, "capture", f"{host}/{proc.pid}", "--steps", "2", "--json")
        assert out.returncode == 0, out.stderr
        capture = json.loads(out.stdout)
        assert capture["state"] == "done" and Path(capture["path"]).is_file()


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_open_ssh_tunnel_lasts_while_used(
    transport: str, ssh_env: dict[str, str], sshd, tmp_path: Path
) -> None:
    env = {**ssh_env, "TORCHTOP_PORT": str(free_port_pair())} if transport == "tcp" else ssh_env
    with training_agent(tmp_path, env) as (proc, info):
        assert info.transport == transport
        with ssh.open_ssh(f"{sshd['host']}/{proc.pid}") as endpoint:
            assert endpoint.transport == transport and sshd["host"] in str(endpoint)
            if transport == "ipc":  # the local ends: Unix sockets in a private directory of ours
                sock_dir = Path(endpoint.address.removeprefix("ipc://")).parent
                assert (
                    stat.S_IMODE(sock_dir.stat().st_mode) == 0o700 and sock_dir.stat().st_uid == os.geteuid()
                )
            else:  # TCP: CURVE, with the key pair the agent's entry (read over ssh) holds
                assert endpoint.host == "127.0.0.1" and endpoint.curve is not None
            client = AgentClient(endpoint)
            try:
                assert client.hello(timeout=10).pid == proc.pid
                assert client.recv_batches(5.0), "no batch came through the tunnel"
            finally:
                client.close()
        assert _closed(endpoint)


def _tunnel_ssh(endpoint: Endpoint) -> list[psutil.Process]:
    """This process's ssh children that forward the endpoint's local ends."""
    first = _local_ends(endpoint)[0]
    return [c for c in psutil.Process().children(recursive=True) if _forwards(c, f"{first}:")]


def _forwards(c: psutil.Process, prefix: str) -> bool:
    try:
        return any(arg.startswith(prefix) for arg in c.cmdline())
    except psutil.Error:  # another test's child, ended (a zombie) or gone: not this tunnel
        return False


def test_a_tunnel_that_dies_is_rebuilt_on_the_same_ports(
    ssh_env: dict[str, str], sshd, tmp_path: Path
) -> None:
    with training_agent(tmp_path, ssh_env) as (proc, _info):
        with ssh.open_ssh(f"{sshd['host']}/{proc.pid}") as endpoint:
            client = AgentClient(endpoint)
            try:
                assert client.hello(timeout=10).pid == proc.pid
                before = client.recv_batches(5.0)
                assert before
                (first,) = _tunnel_ssh(endpoint)
                assert endpoint.link_trouble() == ""
                first.kill()  # what a dropped connection does to ssh: it exits
                first.wait(5)
                deadline = time.monotonic() + 5  # the monitor is told, for its status line
                while time.monotonic() < deadline and not endpoint.link_trouble():
                    time.sleep(0.05)
                trouble = endpoint.link_trouble()
                assert (
                    trouble.startswith("ssh tunnel to ")
                    and "127.0.0.1 down" in trouble
                    and "rebuilding" in trouble
                )
                while batches := client.recv_batches(0.1):  # what was on its way before the drop
                    before += batches
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline and not _tunnel_ssh(endpoint):
                    time.sleep(0.1)
                (second,) = _tunnel_ssh(endpoint)
                assert second.pid != first.pid
                after: list = []
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and not after:
                    after = client.recv_batches(
                        1.0
                    )  # the same sockets: ZeroMQ reconnects through the new tunnel
                assert after, "no batch came through the rebuilt tunnel"
                assert after[0].batch.seq > before[-1].batch.seq
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline and endpoint.link_trouble():
                    time.sleep(0.05)
                assert endpoint.link_trouble() == ""  # up again: nothing to report
                assert client.hello(timeout=10).pid == proc.pid
            finally:
                client.close()
        assert not _tunnel_ssh(endpoint), "the keeper left an ssh behind"
        assert _closed(endpoint)


def test_ssh_errors_say_what_to_do(ssh_env: dict[str, str], sshd, tmp_path: Path) -> None:
    host = sshd["host"]
    out = torchtop(ssh_env, "report", host, "--seconds", "1")  # nothing running there
    assert out.returncode == 2 and "no torchtop agent is running on 127.0.0.1" in out.stderr

    missing = {**ssh_env, ssh.ENV_REMOTE_CMD: "/nonexistent/bin/torchtop"}
    out = torchtop(missing, "ls", host)
    assert (
        out.returncode == 2
        and "is not installed on 127.0.0.1" in out.stderr
        and ssh.ENV_REMOTE_CMD in out.stderr
    )

    closed = f"ssh://127.0.0.1:{free_port()}"
    out = torchtop(ssh_env, "attach", closed)
    assert out.returncode == 2 and "ssh to 127.0.0.1 failed" in out.stderr, out.stderr

    # an agent on TCP, with keys set up as for direct remote access (the same config dir here)
    server_key = keys_cli.make_pair("server")[0]
    keys_cli.authorize(str(keys_cli.make_pair("client")[0]), "monitor")
    tcp = {**ssh_env, "TORCHTOP_PORT": str(free_port_pair()), "TORCHTOP_CURVE": "1"}
    with training_agent(tmp_path, tcp) as (proc, info):
        out = torchtop(ssh_env, "report", f"{host}/1", "--seconds", "1")
        assert out.returncode == 2 and "no torchtop agent with pid or port 1" in out.stderr
        assert f"pid {proc.pid}" in out.stderr  # what is running there, to pick from
        out = torchtop(ssh_env, "report", f"{host}/{info.port}", "--seconds", "1")  # by port
        assert out.returncode == 0 and json.loads(out.stdout)["pid"] == proc.pid, out.stderr
        # no torchtop command there, but a port named: the tunnel goes straight to it, and the
        # agent's public key given by hand reaches it with our own client key
        out = torchtop(missing, "report", f"{host}/{info.port}", "--seconds", "1")
        assert out.returncode == 2 and "--server-key" in out.stderr  # TCP agents answer only CURVE
        out = torchtop(
            missing, "report", f"{host}/{info.port}", "--server-key", str(server_key), "--seconds", "1"
        )
        assert out.returncode == 0 and json.loads(out.stdout)["pid"] == proc.pid, out.stderr
