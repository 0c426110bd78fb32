"""Helpers for tests that run the agent: read its output back over real loopback sockets."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from torchtop.contract import logcodes
from torchtop.monitor.link.client import AgentClient
from torchtop.monitor.link.targets import Endpoint, from_discovery
from torchtop.monitor.model.steps import StepRecord

if TYPE_CHECKING:
    from torch import nn
    from torch.utils.data import DataLoader


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


def endpoint_for(agent: Any) -> Endpoint:
    """How a local monitor of this user reaches an in-process agent: from its discovery entry
    (ipc sockets by default; TCP with the CURVE keys the entry holds when a port was asked for)."""
    return from_discovery(agent.discovery_info())


def raw_connection(address: str, timeout: float = 1.0) -> socket.socket:
    """A plain socket connected to an agent's ZeroMQ address (ipc:// or tcp://), for raw bytes."""
    if address.startswith("ipc://"):
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(timeout)
        try:
            s.connect(address.removeprefix("ipc://"))
        except OSError:
            s.close()
            raise
        return s
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)


def client_for(agent: Any) -> AgentClient:
    """A monitor client connected to an in-process agent."""
    return AgentClient(endpoint_for(agent))


def snapshot_steps(
    agent: Any, at_least: int, timeout: float = 10.0, kind: str | None = "train"
) -> list[StepRecord]:
    """The agent's history, asked over its ROUTER socket, once it holds `at_least` steps.

    It asks once more after a few publisher ticks, so that a count can be asserted exactly.
    """
    client = client_for(agent)

    def fetch() -> list[StepRecord]:
        reply, steps = client.snapshot(timeout=5.0)
        assert reply.ok, reply.error
        return [s for s in steps if kind is None or s.kind == kind]

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


# -- a small CPU training loop (torch imported on use: monitor-only tests import this module too) -
def mlp() -> nn.Sequential:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4))


def tensor_loader(n_batches: int, batch_size: int = 16, **kw) -> DataLoader:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(1)
    ds = TensorDataset(
        torch.randn(n_batches * batch_size, 32, generator=g),
        torch.randint(0, 4, (n_batches * batch_size,), generator=g),
    )
    return DataLoader(ds, batch_size=batch_size, **kw)


def train(model: nn.Module, loader, opt=None, accumulate: int = 1) -> int:
    """A plain loop, not changed for the agent; returns how many optimizer steps it took."""
    import torch
    from torch import nn

    opt = opt or torch.optim.SGD(model.parameters(), lr=0.05)
    steps = 0
    for k, (x, y) in enumerate(loader, 1):
        loss = nn.functional.cross_entropy(model(x), y) / accumulate
        loss.backward()
        if k % accumulate == 0:
            opt.step()
            opt.zero_grad()
            steps += 1
    return steps


def check_records(steps: list[StepRecord]) -> None:
    """Invariants of every record: all phases present, they tile the wall time exactly."""
    for s in steps:
        assert set(s.phases) == set(logcodes.PHASES), s
        assert all(v >= 0 for v in s.phases.values()), s
        assert sum(s.phases.values()) == s.wall_ns, s
        assert s.wall_ns > 0


def cpu_state(steps: list[StepRecord], now: float, start: float) -> Any:
    """A monitor's RunState holding `steps`: one CPU agent's hello (started at `start`) and one
    batch sent at `now`."""
    from torchtop.contract.wire import PROTOCOL_VERSION, Batch, Hello
    from torchtop.monitor.model.state import RunState

    state = RunState()
    hello = Hello(
        v=PROTOCOL_VERSION, run_id="r", pid=1, host="h", port=1, pub_port=2, device="cpu", start_time=start
    )
    state.apply_hello(hello)
    state.apply_batch(Batch(v=PROTOCOL_VERSION, run_id="r", seq=0, time=now), steps, 0.0)
    return state


def diagnosed(steps: list[StepRecord]) -> Any:
    """The verdict over `steps` as a monitor holding them sees it (one CPU agent's hello, one batch)."""
    from torchtop.monitor.diagnosis.diagnose import diagnose

    return diagnose(cpu_state(steps, steps[-1].t0 + 1.0, steps[0].t0))


class CaptureProbe:
    """What a capture uses of the probe: its step-boundary hooks (`on_step` runs them) and the
    training steps ended so far (a capture starts at a step: at_step, start_step)."""

    def __init__(self) -> None:
        from torchtop.agent.hooks.step_hooks import StepHooks

        self.on_step: Any = None
        self.active = True
        self.steps = 0
        self.hooks = StepHooks(self)
