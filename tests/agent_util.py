"""Helpers for tests that run the agent: read its output back over real loopback sockets."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterable, Iterator
from typing import Any

from torchtop.agent import wire
from torchtop.monitor.client import AgentClient
from torchtop.monitor.targets import Endpoint


def cuda_in_use() -> bool:
    """This process initialised CUDA (a GPU machine, after a CUDA test): the agent then reports
    the GPU, and the CPU-only paths are checked where it has not."""
    import torch

    return torch.cuda.is_available() and torch.cuda.is_initialized()


def free_port() -> int:
    """A loopback port free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair() -> int:
    """A port p with p and p + 1 both free right now (an agent's request and batch ports)."""
    for _ in range(100):
        port = free_port()
        if port >= 65534:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair")


def client_for(agent: Any) -> AgentClient:
    """A monitor client connected to an in-process agent on loopback."""
    return AgentClient(Endpoint("127.0.0.1", agent.port))


def snapshot_steps(agent: Any, at_least: int, timeout: float = 10.0, kind: str | None = "train") -> list[wire.StepRecord]:
    """The agent's history, asked over its ROUTER socket, once it holds `at_least` steps.

    It asks once more after a few publisher ticks, so that a count can be asserted exactly.
    """
    client = client_for(agent)

    def fetch() -> list[wire.StepRecord]:
        reply = client.snapshot(timeout=5.0)
        assert reply.ok, reply.error
        return [s for s in reply.steps if kind is None or s.kind == kind]

    try:
        deadline = time.monotonic() + timeout
        while len(fetch()) < at_least and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        return fetch()
    finally:
        client.close()


def median(values: list[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def inner_step(cls: type) -> object:
    """What torch's step wrapper of optimizer class `cls` calls (its closure cell `func`)."""
    wrapper = cls.__dict__["step"]
    return wrapper.__closure__[wrapper.__code__.co_freevars.index("func")].cell_contents


def waited(items: Iterable[Any], waits: list[int]) -> Iterator[Any]:
    """`items`, appending to `waits` the ns each `next()` took: the training thread's own wait."""
    it = iter(items)
    while True:
        t = time.perf_counter_ns()
        try:
            item = next(it)
        except StopIteration:
            return
        waits.append(time.perf_counter_ns() - t)
        yield item
