"""A tiny CPU training loop with the agent, in a child process, for the security and SSH tests."""

from __future__ import annotations

import getpass
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torchtop.contract import discovery

TRAIN = r"""
import sys, time, torch
import torchtop.agent

torch.set_num_threads(1)
torchtop.agent.start()
model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x, y = torch.randn(64, 128), torch.randn(64, 1)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
"""


@contextmanager
def training_agent(
    tmp_path: Path, env: dict[str, str], seconds: float = 120.0
) -> Iterator[tuple[subprocess.Popen[bytes], discovery.AgentInfo]]:
    """Start the loop (agent inside) and yield (process, its discovery entry); kill it afterwards."""
    script = tmp_path / "train_tiny.py"
    script.write_text(TRAIN)
    log = (tmp_path / "train.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, str(script), str(seconds)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 60
        info = None
        while info is None and time.monotonic() < deadline and proc.poll() is None:
            info = next((a for a in discovery.list_agents() if a.pid == proc.pid), None)
            time.sleep(0.05)
        if info is None:
            log.flush()
            raise AssertionError(
                f"the training agent did not start: {(tmp_path / 'train.log').read_text()[-2000:]}"
            )
        yield proc, info
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


SSHD = shutil.which("sshd") or next(
    (p for p in ("/usr/sbin/sshd", "/usr/local/sbin/sshd") if os.path.exists(p)), None
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def loopback_sshd(d: Path, sshd_extra: str = "", client_extra: str = "") -> Iterator[dict[str, Any] | str]:
    """A private sshd on 127.0.0.1 accepting one throwaway key for the current user: yields
    {"port", "opts" (ssh -F its config), "host" (ssh://user@127.0.0.1:port)}, or the reason it
    cannot run here (a string: the caller skips)."""
    if SSHD is None or shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
        yield "needs OpenSSH (sshd, ssh, ssh-keygen): apt-get install -y openssh-server"
        return
    for name in ("host_key", "user_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True)
    shutil.copy(d / "user_key.pub", d / "authorized_keys")
    port = _free_port()
    (d / "sshd_config").write_text(
        f"ListenAddress 127.0.0.1\nHostKey {d / 'host_key'}\nPidFile {d / 'sshd.pid'}\n"
        f"AuthorizedKeysFile {d / 'authorized_keys'}\nPermitRootLogin yes\nStrictModes no\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
        f"AllowTcpForwarding yes\nLogLevel ERROR\n{sshd_extra}"
    )
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # its privilege-separation directory
    check = subprocess.run([SSHD, "-t", "-f", str(d / "sshd_config")], capture_output=True, text=True)
    if check.returncode != 0:
        yield f"sshd cannot run here: {check.stderr.strip()}"
        return
    log = (d / "sshd.log").open("wb")
    proc = subprocess.Popen(
        [SSHD, "-D", "-e", "-f", str(d / "sshd_config"), "-p", str(port)], stdout=log, stderr=log
    )
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        if proc.poll() is not None or time.monotonic() >= deadline:
            yield f"sshd did not start: {(d / 'sshd.log').read_text()[-500:]}"
            return
        (d / "ssh_config").write_text(
            f"{client_extra}Host *\n  IdentityFile {d / 'user_key'}\n  IdentitiesOnly yes\n"
            "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n"
            "  PreferredAuthentications publickey\n"
        )
        yield {
            "port": port,
            "opts": f"-F {shlex.quote(str(d / 'ssh_config'))}",
            "host": f"ssh://{getpass.getuser()}@127.0.0.1:{port}",
        }
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
