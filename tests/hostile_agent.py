"""A same-user process posing as an agent: real ipc sockets and a discovery file in this test's
runtime directory, answering hello / snapshot / memory, and publishing batches whose numbers
the test chooses (NaN step times, infinite offsets). Runs on a thread of the test process, so its
discovery entry names the test's own pid (alive)."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from torchtop.contract import discovery, wire
from torchtop.contract import logcodes as L

V = wire.PROTOCOL_VERSION
MS = 1_000_000


def steps_log(t0: int, n: int, device_ms: float | None = None) -> list[Any]:
    """`n` timed training steps of 5 ms from `t0` (perf_counter ns), as packed entries; with a
    device time on each step end when `device_ms` is given."""
    out: list[Any] = []
    t = t0
    for _ in range(n):
        for code in (
            L.DATA,
            L.EXIT | L.DATA,
            L.FORWARD_START,
            L.EXIT | L.FORWARD,
            L.BACKWARD,
            L.EXIT | L.BACKWARD,
        ):
            t += MS // 2
            out.append(t << L.SHIFT | code)
        t += MS
        out.append(t << L.SHIFT | L.OPTIMIZER)
        t += MS
        end = t << L.SHIFT | L.STEP_END
        out.append(end if device_ms is None else (end, device_ms, 0))
    return out


class HostileAgent(threading.Thread):
    """Publishes `batch(seq)` ten times a second; answers hello, snapshot (with `snapshot_log`)
    and memory."""

    def __init__(self, batch: Callable[[int], wire.Batch], snapshot_log: list[wire.LogChunk] | None = None):
        super().__init__(daemon=True)
        self.batch = batch
        self.snapshot_log = snapshot_log or []
        self.halt = threading.Event()
        self.pid = os.getpid()
        self.run_id = "hostile"
        directory = discovery.runtime_dir()
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.req, self.pub = (f"ipc://{directory}/hostile-{self.pid}.{s}" for s in ("req", "pub"))
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(self.req)
        self.xpub = self.ctx.socket(zmq.XPUB)
        self.xpub.bind(self.pub)
        self.hello = wire.Hello(
            v=V, run_id=self.run_id, pid=self.pid, host=socket.gethostname(), port=0, pub_port=0,
            device="cpu", start_time=time.time(), argv=["hostile.py"],
        )  # fmt: skip
        info = discovery.AgentInfo(pid=self.pid, transport="ipc", address=self.req, pub_address=self.pub)
        info.start_time, info.run_id, info.argv, info.rank = time.time(), self.run_id, ["hostile.py"], 0
        self.file = discovery.write(info)

    def run(self) -> None:
        seq = 0
        next_at = time.monotonic()
        while not self.halt.is_set():
            if self.router.poll(20):
                peer, *rest = self.router.recv_multipart()
                req = wire.decode(rest[-1])
                assert isinstance(req, wire.Request)
                reply = wire.Reply(v=V, id=req.id, ok=True, run_id=self.run_id, seq=seq - 1)
                if req.cmd == "hello":
                    reply.hello = self.hello
                elif req.cmd == "snapshot":
                    reply.log = self.snapshot_log
                    reply.wall_offset = time.time() - time.perf_counter()
                self.router.send_multipart([peer, *rest[:-1], wire.encode(reply)])
            while self.xpub.poll(0):
                self.xpub.recv()  # subscriptions
            if time.monotonic() >= next_at:
                next_at += 0.1
                self.xpub.send(wire.encode(self.batch(seq)))
                seq += 1

    def close(self) -> None:
        self.halt.set()
        self.join(5)
        self.ctx.destroy(linger=0)
        self.file.unlink(missing_ok=True)
