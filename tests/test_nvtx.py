"""TORCHTOP_NVTX=1: the phases as NVTX ranges on the steps sampled for CUDA events (fake GPU, CPU)."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from tests.test_device_times import FakeGpu, FakePool, _one_step
from torchtop.agent.hooks import nvtx
from torchtop.agent.hooks.probe import Probe
from torchtop.contract.logcodes import BACKWARD, COMM_READY, EXIT

if TYPE_CHECKING:
    from torchtop.agent.loop.cuda_events import EventPool


class FakeNvtx:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.depth = 0

    def range_push(self, name: str) -> int:
        self.calls.append(name)
        self.depth += 1
        return self.depth

    def range_pop(self) -> int:
        self.calls.append("pop")
        self.depth -= 1
        return self.depth


def test_event_steps_push_a_range_per_phase_and_other_steps_none() -> None:
    gpu = FakeGpu()
    probe = Probe()
    probe.pool, probe.event_every = cast("EventPool", FakePool(gpu)), 2  # the calls of an EventPool
    fake = FakeNvtx()
    assert nvtx.enable(probe, fake)
    for _ in range(6):
        _one_step(probe, gpu)
    pushes = [c for c in fake.calls if c != "pop"]
    # the event steps of the six (1 in 2, from the first boundary on): forward, backward, optimizer each
    triple = ["torchtop forward", "torchtop backward", "torchtop optimizer"]
    assert pushes in (triple * 2, triple * 3), fake.calls
    assert fake.depth == 0


def test_the_end_of_backward_wait_is_a_comm_range_inside_the_backward() -> None:
    probe = Probe()
    fake = FakeNvtx()
    put = nvtx.NvtxPut(lambda item: None, fake.range_push, fake.range_pop)
    for code in (BACKWARD, COMM_READY, EXIT | BACKWARD):
        put(12345 << 8)  # a time item passes by
        put(code)
    assert fake.calls == ["torchtop backward", "torchtop comm", "pop", "pop"] and fake.depth == 0
    assert probe.event_put is None  # nothing changes unless asked


def test_off_unless_asked(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("TORCHTOP_NVTX", raising=False)
    assert not nvtx.wanted()
    monkeypatch.setenv("TORCHTOP_NVTX", "1")
    assert nvtx.wanted()
