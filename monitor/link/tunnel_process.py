"""An ssh tunnel's process (ssh.py builds its command): launched, waited for until both local
ends take a connection, stopped; and the keeper that brings a tunnel that died back up on the
same local ends while it is in use."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from typing import Any

TUNNEL_TIMEOUT_S = 20.0
RESTART_MIN_S, RESTART_MAX_S = 0.5, 8.0  # backoff between attempts to rebuild a dead tunnel


def accepts(local: str) -> bool:
    """Whether a local end of the tunnel (tcp://127.0.0.1:PORT or ipc://PATH) takes a connection."""
    try:
        if local.startswith("ipc://"):
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(0.2)
                s.connect(local.removeprefix("ipc://"))
        else:
            with socket.create_connection(("127.0.0.1", int(local.rsplit(":", 1)[1])), timeout=0.2):
                pass
        return True
    except OSError:
        return False


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(3)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def launch(cmd: list[str], err: Any) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)


def wait_up(proc: subprocess.Popen[bytes], local: tuple[str, str], timeout: float) -> bool:
    """True once both local ends accept; False if ssh exited or the time ran out."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if all(accepts(end) for end in local):
            return True
        time.sleep(0.05)
    return False


class Keeper:
    """Brings a tunnel that died (network drop, sshd restart, laptop sleep) back up on the same
    local ends, with backoff, for as long as it is in use. ZeroMQ reconnects by itself, so
    the monitor's sockets carry on once they forward again."""

    def __init__(
        self, cmd: list[str], proc: subprocess.Popen[bytes], local: tuple[str, str], host: str
    ) -> None:
        self.cmd, self.proc, self.local, self.host = cmd, proc, local, host
        self.down_since: float | None = None  # monotonic time the tunnel went down; None while up
        self.attempts = 0  # rebuilds tried since then
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="torchtop-ssh-keeper", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        delay = RESTART_MIN_S
        while not self._stop.is_set():
            if self.proc.poll() is None:
                try:
                    self.proc.wait(0.5)
                except subprocess.TimeoutExpired:
                    continue
            if self.down_since is None:
                self.down_since = time.monotonic()
            if self._stop.wait(delay):
                return
            self.attempts += 1
            proc = launch(self.cmd, subprocess.DEVNULL)
            self.proc = proc
            if self._stop.is_set():
                return  # close() may have stopped the old one while this one started
            if wait_up(proc, self.local, TUNNEL_TIMEOUT_S):
                delay = RESTART_MIN_S
                self.down_since, self.attempts = None, 0
                continue
            stop(proc)  # the host is still out of reach: try again later
            delay = min(delay * 2, RESTART_MAX_S)

    def trouble(self) -> str:
        """What the monitor shows while the tunnel is down ("" while it is up)."""
        since = self.down_since
        if since is None:
            return ""
        tried = f", {self.attempts} attempt{'s' if self.attempts != 1 else ''}" if self.attempts else ""
        return f"ssh tunnel to {self.host} down {time.monotonic() - since:.0f}s, rebuilding{tried}"

    def close(self) -> None:
        self._stop.set()
        stop(self.proc)
        self._thread.join(5)
        stop(self.proc)  # one the keeper launched just as it was told to stop
