"""Helpers for the load and fuzz tests: a monitor that keeps every step it is sent, and peers that
speak raw ZMTP (an attack made in advance and sent on a plain TCP socket costs the attacker next
to nothing, so what the training process pays is the agent's doing)."""

from __future__ import annotations

import socket
import threading
import time

from tests.agent_util import raw_connection
from torchtop.contract import wire
from torchtop.monitor.link.client import AgentClient
from torchtop.monitor.link.targets import Endpoint


def send_raw(address: str, data: bytes) -> None:
    """`data` on a fresh connection to `address` (ignored when it cannot connect)."""
    try:
        with raw_connection(address) as s:
            s.sendall(data)
    except OSError:
        pass


class Watcher(threading.Thread):
    """A monitor on the stream: every step the agent publishes, as (end wall time, wall ms)."""

    def __init__(self, endpoint: Endpoint) -> None:
        super().__init__(daemon=True)
        self.client = AgentClient(endpoint)
        self.steps: list[tuple[float, float]] = []
        self.last: wire.Batch | None = None
        self.halt = threading.Event()

    def run(self) -> None:
        try:
            while not self.halt.is_set():
                for got in self.client.recv_batches(0.2):
                    self.last = got.batch
                    self.steps += [(s.t0 + s.wall_ns / 1e9, s.wall_ns / 1e6) for s in got.steps]
        finally:
            self.client.close()

    def between(self, start: float, end: float) -> list[float]:
        return [ms for t, ms in list(self.steps) if start <= t <= end]

    def wait_until(self, t: float, timeout: float = 60) -> None:
        """Until a step that ended after `t` (wall clock) has arrived."""
        deadline = time.monotonic() + timeout
        while (not self.steps or self.steps[-1][0] < t) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert self.steps and self.steps[-1][0] >= t, "the agent stopped publishing"

    def wait_steps(self, n: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while len(self.steps) < n and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(self.steps) >= n, f"only {len(self.steps)} steps published"


# ZMTP 3.0 as a DEALER speaks it (NULL mechanism): an attack is bytes made in advance and sent
# on a plain TCP socket, which costs the attacker next to nothing, so what the training process
# pays is the agent's doing
GREETING = b"\xff" + b"\x00" * 7 + b"\x01\x7f\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32
_READY = b"\x05READY\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER"
READY = b"\x04" + bytes([len(_READY)]) + _READY


def empty_frames(n: int) -> bytes:
    """One message of `n` empty frames, as ZMTP puts it on the wire (2 bytes a frame)."""
    return b"\x01\x00" * (n - 1) + b"\x00\x00"


def request(cmd: str, args: dict | None = None) -> bytes:
    """One request as a one-frame ZMTP message."""
    body = wire.encode(wire.Request(v=wire.PROTOCOL_VERSION, id=7, cmd=cmd, args=args or {}))
    assert len(body) < 256
    return bytes([0, len(body)]) + body


class RawPeer(threading.Thread):
    """Connects to a ROUTER's address, sends `stream` (ZMTP messages) as fast as the agent
    takes it, then keeps the connection open; counts the bytes that come back (`received`,
    the agent's greeting included)."""

    def __init__(self, address: str, stream: bytes) -> None:
        super().__init__(daemon=True)
        self.address, self.stream = address, stream
        self.received = 0
        self.halt = threading.Event()
        self.sent = threading.Event()  # the whole stream went out

    def run(self) -> None:
        with raw_connection(self.address, timeout=60) as s:
            s.sendall(GREETING)
            while self.received < len(GREETING):  # the agent's greeting: it has read ours
                self.received += len(s.recv(4096))
            s.setblocking(False)
            out = memoryview(READY + self.stream)
            while out and not self.halt.is_set():
                try:
                    out = out[s.send(out[: 1 << 20]) :]
                except BlockingIOError:
                    time.sleep(0.005)
                self._drain(s)
            self.sent.set()
            while not self.halt.wait(0.05):
                self._drain(s)

    def _drain(self, s: socket.socket) -> None:
        try:
            while chunk := s.recv(1 << 16):
                self.received += len(chunk)
        except BlockingIOError:
            pass
        except ConnectionResetError:  # the agent dropped the bomb's connection: what the test wants
            self.halt.set()
