"""CUDA device times without a GPU: the probe records fake events on event steps, the agent's
EventResolver waits for them (query(), never a sync) and writes device times into the log, the
log crosses the wire, and the monitor's replay turns it into each step's `device_ms`.

The fake GPU runs a clock that only the test advances: an event completes once the clock
passed the moment it was recorded, as a real one does once the stream reaches it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, cast

from torchtop.agent.hooks.probe import Probe
from torchtop.agent.hooks.timed import timed
from torchtop.agent.loop import cuda_events as cuda_timing
from torchtop.agent.loop.cuda_events import EventResolver
from torchtop.contract import logcodes, wire
from torchtop.monitor.model.log_replay import LogReplay

if TYPE_CHECKING:
    from torchtop.agent.loop.cuda_events import EventPool

BACKWARD, FORWARD, OPTIMIZER = logcodes.BACKWARD, logcodes.FORWARD, logcodes.OPTIMIZER


class FakeGpu:
    def __init__(self) -> None:
        self.queued_ms = 0.0  # where the stream's work ends
        self.done_ms = 0.0  # how far the device has executed

    def launch(self, ms: float) -> None:
        self.queued_ms += ms


class FakeEvent:
    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu
        self.at: float | None = None
        self.syncs = 0

    def record(self, stream: Any = None) -> None:
        self.at = self.gpu.queued_ms

    def query(self) -> bool:
        return self.at is not None and self.gpu.done_ms >= self.at

    def elapsed_time(self, end: FakeEvent) -> float:
        if not (self.query() and end.query()):
            raise RuntimeError("event not completed")  # as torch does: never a silent sync
        return end.at - self.at  # type: ignore[operator]

    def synchronize(self) -> None:
        self.syncs += 1
        raise AssertionError("synchronize() called")


class FakePool:
    def __init__(self, gpu: FakeGpu, size: int = 64) -> None:
        self.gpu = gpu
        self.free = [FakeEvent(gpu) for _ in range(size)]
        self.size = size
        self.misses = 0

    def recorded(self, stream: Any) -> FakeEvent | None:
        if not self.free:
            self.misses += 1
            return None
        ev = self.free.pop()
        ev.record(stream)
        return ev

    def give(self, ev: FakeEvent) -> None:
        assert ev not in self.free, "an event returned twice"
        self.free.append(ev)

    def current_stream(self) -> None:
        return None

    def top_up(self) -> None:
        pass


def _one_step(probe: Probe, gpu: FakeGpu) -> None:
    """forward 2 ms, backward 3 ms, optimizer 1 ms of device work; a 0.5 ms h2d copy first."""
    ev0 = probe.record() if probe.event_step else None
    gpu.launch(0.5)
    ev1 = probe.record() if ev0 is not None else None
    probe.h2d(probe_stamp(), 1000, 4096, True, ev0, ev1)
    for phase, ms in ((FORWARD, 2.0), (BACKWARD, 3.0), (OPTIMIZER, 1.0)):
        probe.enter(phase)
        gpu.launch(ms)
        probe.exit(phase)
    probe.cut()


def probe_stamp() -> int:
    from time import perf_counter_ns

    return perf_counter_ns()


def _setup() -> tuple[Probe, FakeGpu, FakePool, EventResolver]:
    gpu = FakeGpu()
    pool = FakePool(gpu)
    as_pool = cast("EventPool", pool)  # the calls of an EventPool, on a fake GPU
    probe = Probe()
    probe.pool, probe.event_every = as_pool, 2
    return probe, gpu, pool, EventResolver(as_pool)


def _ship(chunks: list[tuple[list[Any], int]], first_seq: int = 0) -> list[wire.LogChunk]:
    """Through the wire, as the publisher sends them."""
    batch = wire.Batch(
        v=wire.PROTOCOL_VERSION,
        run_id="r",
        seq=0,
        time=0.0,
        log=[wire.LogChunk(first_seq + k, steps, entries) for k, (entries, steps) in enumerate(chunks)],
    )
    decoded = wire.decode(wire.encode(batch))
    assert isinstance(decoded, wire.Batch)
    return decoded.log


def test_device_times_wait_for_the_gpu_then_reach_the_monitor() -> None:
    probe, gpu, pool, resolver = _setup()
    for _ in range(8):
        _one_step(probe, gpu)
    entries, steps = probe.drain()
    assert steps == 8
    assert resolver.run(entries, steps) == []  # the GPU has not run anything: the chunk waits
    gpu.done_ms = gpu.queued_ms / 2
    assert resolver.poll() == []  # half done: still waiting, in order
    gpu.done_ms = gpu.queued_ms
    ready = resolver.poll()
    assert len(ready) == 1 and resolver.pending() == 0
    # every event went back to the pool, once, but the start event of the step now open
    assert len(pool.free) == pool.size - 1
    assert resolver.event_steps == 3  # steps 2, 4, 6 are event steps (8's starts the next one)

    records = LogReplay().feed(_ship(ready), wall_offset=0.0, rank=0, flush=True)
    assert len(records) == 8
    evented = [r for r in records if r.device_ms]
    assert [r.i for r in evented] == [2, 4, 6]
    for r in evented:
        assert abs(r.device_ms["forward"] - 2.0) < 1e-9
        assert abs(r.device_ms["backward"] - 3.0) < 1e-9
        assert abs(r.device_ms["optimizer"] - 1.0) < 1e-9
        assert abs(r.device_ms["h2d"] - 0.5) < 1e-9
        assert abs(r.device_ms["step"] - 6.5) < 1e-9  # boundary to boundary on the stream
    # (the first step opens at its forward: the log's first entry, the copy, has no step yet)
    assert all(r.h2d_bytes == {"pinned": 4096} for r in records[1:])


def _stamp_item(probe: Probe, item: object) -> None:
    from time import perf_counter_ns

    probe._append(perf_counter_ns())
    probe._append(item)  # type: ignore[arg-type]


def _event_steps(probe: Probe, gpu: FakeGpu, resolver: EventResolver) -> list[Any]:
    """The logged steps, their events completed, resolved and replayed: those with device times."""
    entries, steps = probe.drain()
    resolver.run(entries, steps)
    gpu.done_ms = gpu.queued_ms
    records = LogReplay().feed(_ship(resolver.poll()), wall_offset=0.0, rank=0, flush=True)
    evented = [r for r in records if r.device_ms]
    assert evented
    return evented


def test_a_wait_inside_forward_and_backward_leaves_them_their_compute_on_the_gpu_too() -> None:
    """FSDP2 on CUDA: the compute stream waits for an all-gather inside forward and backward.
    Device forward and backward are their compute, as on the host; the waits are comm (before,
    a forward read its wait too, and a rank held by a slower one looked as slow as it)."""
    probe, gpu, _pool, resolver = _setup()
    comm = logcodes.COMM
    for _ in range(4):
        probe.enter(FORWARD)
        gpu.launch(1.0)
        for wait in (4.0, 0.5):  # the compute stream waits for two all-gathers, the first dp's
            probe.enter(comm)
            if wait == 4.0:
                _stamp_item(probe, (logcodes.COMM_GROUP, "dp"))  # as groups.log_group logs it
            gpu.launch(wait)
            probe.exit(comm)
            gpu.launch(1.0)
        probe.exit(FORWARD)
        probe.enter(BACKWARD)
        gpu.launch(2.0)
        probe.enter(comm)
        gpu.launch(3.0)
        probe.exit(comm)
        gpu.launch(2.0)
        probe.exit(BACKWARD)
        probe.enter(OPTIMIZER)
        gpu.launch(1.0)
        probe.exit(OPTIMIZER)
        probe.cut()
    evented = _event_steps(probe, gpu, resolver)
    for r in evented:
        dev = r.device_ms
        assert abs(dev["forward"] - 3.0) < 1e-9, dev
        assert abs(dev["backward"] - 4.0) < 1e-9, dev
        assert abs(dev["comm"] - 7.5) < 1e-9, dev
        assert abs(dev["forward"] + dev["backward"] + dev["comm"] + dev["optimizer"] - dev["step"]) < 1e-9
        assert r.device_groups == {"dp": 4.0}  # the named wait's device time, by its group


def test_a_wait_in_a_phase_without_device_times_reopens_nothing() -> None:
    """A pipeline chunk opens forward without CUDA events (its nested root forward has them); a
    wait inside the chunk but outside that root forward pauses no device pair, so none reopens
    (a stray one, closed later by the next micro-batch's forward, counted its wait twice)."""
    from time import perf_counter_ns

    probe, gpu, _pool, resolver = _setup()
    comm = logcodes.COMM
    for _ in range(4):
        probe.enter(FORWARD)  # the root forward: device times
        gpu.launch(2.0)
        probe.exit(FORWARD)
        probe._append(perf_counter_ns())  # the chunk's own forward: no event
        probe._append(FORWARD)
        probe.enter(comm)
        gpu.launch(1.0)
        probe.exit(comm)
        probe._append(perf_counter_ns())
        probe._append(logcodes.EXIT | FORWARD)
        probe.enter(FORWARD)  # the next micro-batch's root forward, with a wait of its own
        gpu.launch(1.0)
        probe.enter(comm)
        gpu.launch(1.0)
        probe.exit(comm)
        gpu.launch(1.0)
        probe.exit(FORWARD)
        gpu.launch(0.5)  # the optimizer's, as far as the step's events go
        probe.cut()
    evented = _event_steps(probe, gpu, resolver)
    for r in evented:
        assert abs(r.device_ms["forward"] - 4.0) < 1e-9, r.device_ms
        assert abs(r.device_ms["comm"] - 2.0) < 1e-9, r.device_ms


def test_the_stride_follows_the_recording_cost_and_is_worked_out_once_per_new_sample(
    monkeypatch: Any,
) -> None:
    probe, gpu, pool, resolver = _setup()
    monkeypatch.setattr(cuda_timing, "BUDGET", 0.05)  # 100 us of a 2 ms step: the fake records fit
    for _ in range(8):
        _one_step(probe, gpu)
        time.sleep(0.002)
    gpu.done_ms = gpu.queued_ms
    resolver.run(*probe.drain())
    assert resolver.event_steps == 3
    assert resolver.stride(8) == 1
    assert resolver.stride(77) == 77  # no event step since: kept as it is, no sorting
    monkeypatch.setattr(cuda_timing, "BUDGET", 1e-9)
    for _ in range(4):
        _one_step(probe, gpu)
    gpu.done_ms = gpu.queued_ms
    resolver.run(*probe.drain())
    assert resolver.stride(77) == 1000  # new samples: worked out again (at the new budget, the cap)


def test_an_event_step_records_events_around_compute_but_not_the_data_wait() -> None:
    probe, gpu, pool, resolver = _setup()
    fetch = timed(probe, logcodes.DATA, lambda it: None, events=False)  # as the DataLoader's __next__
    backward = timed(probe, BACKWARD, lambda loss: gpu.launch(3.0))
    while not probe.event_step:
        probe.cut()
    free = len(pool.free)  # the event step's start event is out already
    fetch(None)
    backward(None)
    probe.cut()
    entries, steps = probe.drain()
    evented = entries[
        entries.index(
            next(e for e in entries if type(e) is tuple and e[0] & logcodes.MASK == logcodes.STEP_EVENT)
        ) :
    ]
    codes = [(e if isinstance(e, int) else e[0]) & logcodes.MASK for e in evented]
    assert codes[1:6] == [
        logcodes.DATA,
        logcodes.EXIT | logcodes.DATA,
        BACKWARD,
        logcodes.EXIT | BACKWARD,
        logcodes.BOUNDARY,
    ]
    assert [type(e) for e in evented[1:6]] == [int, int, tuple, tuple, tuple]  # no event at the data wait
    # the backward's two events and the step end's (and the next step's start, if an event step too)
    assert free - len(pool.free) == 3 + probe.event_step
    gpu.done_ms = gpu.queued_ms
    records = LogReplay().feed(_ship(resolver.run(entries, steps)), wall_offset=0.0, rank=0, flush=True)
    timed_step = [r for r in records if r.device_ms][-1]
    assert timed_step.device_ms == {"step": 3.0, "backward": 3.0}
    assert timed_step.phases["data"] >= 0


def test_an_event_step_split_across_chunks_keeps_its_device_times() -> None:
    probe, gpu, pool, resolver = _setup()
    _one_step(probe, gpu)
    _one_step(probe, gpu)  # its cut starts the next event step: step 2
    probe.enter(FORWARD)
    gpu.launch(2.0)
    probe.exit(FORWARD)
    first = probe.drain()  # the agent ticks in the middle of the event step
    probe.enter(BACKWARD)
    gpu.launch(3.0)
    probe.exit(BACKWARD)
    probe.cut()
    second = probe.drain()
    gpu.done_ms = gpu.queued_ms
    ready = resolver.run(*first) + resolver.run(*second)
    assert len(ready) == 2 and len(pool.free) == pool.size
    records = LogReplay().feed(_ship(ready), 0.0, 0, flush=True)
    assert [r.i for r in records] == [0, 1, 2]
    assert records[2].device_ms == {"forward": 2.0, "backward": 3.0, "step": 5.0}


def test_events_that_never_complete_are_given_up_not_waited_on(monkeypatch: Any) -> None:
    """A hung stream: after GIVE_UP_S the chunk goes without device times, its events stay out
    of the pool (they may still complete), and later chunks are not held behind it."""
    from torchtop.agent.loop import cuda_events as cuda_timing

    probe, gpu, pool, resolver = _setup()
    for _ in range(4):
        _one_step(probe, gpu)
    assert resolver.run(*probe.drain()) == []
    monkeypatch.setattr(cuda_timing, "GIVE_UP_S", -1.0)
    ready = resolver.poll()
    assert len(ready) == 1 and resolver.abandoned == 1
    records = LogReplay().feed(_ship(ready), 0.0, 0, flush=True)
    assert len(records) == 4 and not any(r.device_ms for r in records)
    assert len(pool.free) < pool.size


def test_cuda_marks_are_read_once_their_copy_landed() -> None:
    gpu = FakeGpu()
    probe = Probe()
    resolver = EventResolver(None)
    done = FakeEvent(gpu)
    gpu.launch(1.0)
    done.record()

    class Pinned:
        def __float__(self) -> float:
            return 0.25

    probe.enter(FORWARD)
    probe.exit(FORWARD)
    probe.cut()
    probe.mark("loss", cast("Any", (Pinned(), done)))  # a pinned scalar and its copy's event, faked
    probe.mark("lr", 0.1)
    assert resolver.run(*probe.drain()) == []
    gpu.done_ms = 1.0
    ready = resolver.poll()
    records = LogReplay().feed(_ship(ready), 0.0, 0, flush=True)
    assert records[0].marks == {"loss": 0.25, "lr": 0.1}  # right after the step's end: its marks


def test_replay_joins_late_and_skips_what_it_has() -> None:
    """A monitor joining mid-run: the first step (its start not seen) is left out, chunks seen
    twice are replayed once, and a gap forgets the open step."""
    probe = Probe()
    chunks = []
    for _ in range(4):
        for _ in range(3):
            probe.enter(FORWARD)
            probe.exit(FORWARD)
            probe.cut()
        probe.enter(FORWARD)  # a step open across the tick
        chunks.append(probe.drain())
        probe.exit(FORWARD)
    log = _ship(chunks)
    replay = LogReplay()
    first = replay.feed(log[1:2], 0.0, 0, flush=True)  # joins at chunk 1
    assert [r.i for r in first] == [4, 5]  # numbered as the agent counts; step 3 began unseen
    again = replay.feed(log[1:3], 0.0, 0, flush=True)  # chunk 1 again (a catch-up), then 2
    assert [r.i for r in again] == [6, 7, 8]
    assert [r.i for r in replay.feed(log[3:], 0.0, 0, flush=True)] == [9, 10, 11]
    replay2 = LogReplay()
    replay2.feed(log[:1], 0.0, 0, flush=True)
    gapped = replay2.feed(log[2:3], 0.0, 0, flush=True)  # chunk 1 never came
    assert [r.i for r in gapped] == [7, 8]  # the step open across the gap is not reported
