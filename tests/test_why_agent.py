"""The agent's stack sampler: which phase, which frame, which samples are waits on the device.

Real threads and real torch on CPU. Sync windows and the FLOP count: tests/test_why_sync_flops.py.
"""

from __future__ import annotations

import dis
import json
import sys
import threading
import time
from typing import Any

import pytest

from torchtop.agent.hooks.frames import Kind, classifier_for
from torchtop.agent.hooks.probe import Probe
from torchtop.agent.hooks.timed import timed
from torchtop.agent.telemetry import stacks
from torchtop.agent.telemetry.stacks import OTHER, StackSampler, log_phase
from torchtop.contract.logcodes import (
    BACKWARD,
    DATA,
    FORWARD,
    FORWARD_START,
    H2D_COPY,
    MARK,
    OPTIMIZER,
    STEP_END,
)

torch = pytest.importorskip("torch")


def line_of(fn: Any, text: str) -> int:
    """The line of `fn`'s source that holds `text`."""
    import inspect

    lines, first = inspect.getsourcelines(fn)
    return first + next(k for k, line in enumerate(lines) if text in line)


class Blocked:
    """Runs `body` on a thread of its own, which the probe takes as the training thread."""

    def __init__(self, body: Any) -> None:
        self.ready = threading.Event()
        self.release = threading.Event()
        self._probe: Probe | None = None
        self.lock = threading.Lock()  # what block_in_c blocks on: held_lock's body puts a held one
        self.body = body
        self.thread = threading.Thread(target=self._run, daemon=True)

    @property
    def probe(self) -> Probe:
        """The probe of the thread, made there (it is set once `__enter__` returns)."""
        assert self._probe is not None, "the thread has not started"
        return self._probe

    def _run(self) -> None:
        self._probe = Probe()
        self.body(self)

    def __enter__(self) -> Blocked:
        self.thread.start()
        assert self.ready.wait(5)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release.set()
        self.thread.join(5)


def wait_here(b: Blocked) -> None:
    b.ready.set()
    b.release.wait(10)  # the site: a stdlib frame (threading.Event.wait) called from here


# -- classifying frames ------------------------------------------------------------------------------
def test_classifier_kinds() -> None:
    c = classifier_for(torch)
    assert (
        c.kind(
            torch.nn.functional.linear.__code__
            if hasattr(torch.nn.functional.linear, "__code__")
            else torch.nn.Module.__call__.__code__
        )[1]
        is Kind.TORCH
    )
    assert c.kind(json.dumps.__code__)[1] is Kind.STDLIB
    assert c.kind(line_of.__code__)[1] is Kind.USER
    import zmq

    assert c.kind(zmq.Context.instance.__code__)[1] is Kind.LIB
    wrapper = timed(Probe(thread_id=0), DATA, wait_here)
    assert c.kind(wrapper.__code__)[1:] == (Kind.OURS, DATA)


# -- sampling ----------------------------------------------------------------------------------------
def test_a_sample_names_the_phase_from_our_wrapper_and_the_users_frame() -> None:
    def body(b: Blocked) -> None:
        timed(b.probe, DATA, fetch)(b)

    def fetch(b: Blocked) -> None:
        wait_here(b)

    with Blocked(body) as b:
        s = StackSampler(b.probe, classifier_for(torch)).sample()
    assert s is not None and s.phase == DATA and not s.sync and not s.late
    assert s.site.endswith(f"test_why_agent.py:{line_of(wait_here, 'b.release.wait')} wait_here"), s.site
    assert s.callee == "threading:Event.wait"


def test_a_sample_inside_backward_reads_backward_on_an_untimed_step() -> None:
    """The agent's `torch.autograd.backward` wrapper names its phase by its frame: on a step whose
    phases are not timed nothing is logged, and the sample must not read as time outside the phases."""
    from torchtop.agent.hooks.collectives import timed_backward

    class Waits(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, b: Blocked) -> Any:
            ctx.b = b
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            wait_here(ctx.b)  # CPU autograd runs on the calling thread: the wrapper's frame is below
            return grad, None

    def body(b: Blocked) -> None:
        assert b.probe is not None
        b.probe.untimed = 1
        x = torch.ones(2, requires_grad=True)
        timed_backward(b.probe, torch.autograd.backward, lambda tensors: None)(Waits.apply(x, b).sum())

    with Blocked(body) as b:
        s = StackSampler(b.probe, classifier_for(torch)).sample()
    assert s is not None and s.phase == BACKWARD, s


class WaitingSGD(torch.optim.Optimizer):
    """The user's own optimizer: its step is the optimizer's time, in the user's file."""

    def __init__(self, params: Any, b: Blocked) -> None:
        super().__init__(params, {})
        self.b = b

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        wait_here(self.b)


def test_a_closure_inside_torchs_optimizer_step_is_other_and_the_users_own_step_is_the_optimizer() -> None:
    """optimizer.step(closure) (Lightning's training_step runs so): the closure's code is not the
    optimizer's; a step of the user's own optimizer class is."""
    w = torch.zeros(2, requires_grad=True)

    def closure(b: Blocked) -> None:
        wait_here(b)  # the loss, its logging: the user's code inside torch's SGD.step

    def in_closure(b: Blocked) -> None:
        opt = torch.optim.SGD([w], lr=0.1)
        timed(b.probe, OPTIMIZER, torch.optim.SGD.step)(opt, lambda: closure(b))

    def own_step(b: Blocked) -> None:
        timed(b.probe, OPTIMIZER, WaitingSGD.step)(WaitingSGD([w], b))

    c = classifier_for(torch)
    for body, phase in ((in_closure, OTHER), (own_step, OPTIMIZER)):
        with Blocked(body) as b:
            s = StackSampler(b.probe, c).sample()
        assert s is not None and s.phase == phase, (body.__name__, s)


def test_an_explicit_phase_is_read_off_the_log() -> None:
    """`with phase(...)` has no frame on the stack: the log says which phase is open."""

    def body(b: Blocked) -> None:
        b.probe.forward(FORWARD_START + 2 * 0 + 1)
        wait_here(b)

    with Blocked(body) as b:
        s = StackSampler(b.probe, classifier_for(torch)).sample()
    assert s is not None and s.phase == FORWARD


def test_log_phase() -> None:
    p = Probe(thread_id=0)
    assert log_phase(p) == OTHER  # nothing logged
    p.enter(BACKWARD)
    assert log_phase(p) == BACKWARD
    p.mark("loss", 1.0)  # a mark says nothing of the phase: look further back
    p._append(5)
    p._append((H2D_COPY, 1, 2, False, None))
    assert log_phase(p) == BACKWARD
    p._append(6)  # half a pair: its code is not written yet
    assert log_phase(p) == BACKWARD
    p.log.pop()
    p.exit(BACKWARD)
    assert log_phase(p) == OTHER
    p.enter(DATA)
    p._take()  # drained by the agent thread: the tail it kept still says
    assert p.log == [] and log_phase(p) == DATA
    p._append(7)
    p._append(STEP_END)
    assert log_phase(p) == OTHER
    assert MARK  # (imported for the mark code's sake)


def block_in_c(b: Blocked) -> None:
    b.ready.set()
    b.lock.acquire(timeout=10)  # a C call straight from this frame, as `loss.item()` is


@pytest.mark.slow  # among the fast subset's slowest, ~1.5 s here (issue 27: the subset under 60 s)
def test_dear_samples_make_the_sampler_back_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stacks, "BUDGET", 1e-6)  # a budget no sample fits in

    def body(b: Blocked) -> None:
        wait_here(b)

    with Blocked(body) as b:
        sampler = StackSampler(b.probe, classifier_for(torch), hz=50.0)
        sampler.attended = True
        sampler.start()
        try:
            time.sleep(1.5)
        finally:
            sampler.stop()
    assert sampler.rate == stacks.MIN_HZ and sampler.samples <= 2 * 1.5 * stacks.MIN_HZ + 2


def test_one_dear_sample_does_not_throttle_the_sampler() -> None:
    """A first sighting of new code costs milliseconds once (seen on GPU hosts): the rate stays
    where the usual samples' cost puts it, instead of falling to MIN_HZ for tens of seconds."""

    def body(b: Blocked) -> None:
        wait_here(b)

    def spin(us: float) -> None:
        t = time.thread_time_ns()
        while time.thread_time_ns() - t < us * 1000:
            pass

    with Blocked(body) as b:
        sampler = StackSampler(b.probe, classifier_for(torch), hz=20.0)
        calls = [0]
        before: list[float] = []

        def sample(late: bool = False, now_ns: int | None = None) -> object:
            calls[0] += 1
            dear = calls[0] == stacks.FIRST_SAMPLES + 5
            if dear:
                before.append(sampler.rate)
            spin(30_000.0 if dear else 5.0)
            return object()  # a sample taken

        sampler.sample = sample  # type: ignore[method-assign]
        sampler.attended = True
        sampler.start()
        try:
            deadline = time.monotonic() + 10
            while calls[0] < stacks.FIRST_SAMPLES + 8 and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            sampler.stop()
    assert calls[0] >= stacks.FIRST_SAMPLES + 8 and before, calls
    # the 30 ms sample alone would allow < 1 Hz under BUDGET (MIN_HZ, then tens of seconds back up)
    assert before[0] > 2 * stacks.MIN_HZ and sampler.rate >= 0.5 * before[0], (before, sampler.rate)


def held_lock() -> tuple[threading.Lock, Any]:
    """A lock taken here, and a body for Blocked that blocks on it in C (block_in_c)."""
    lock = threading.Lock()
    lock.acquire()

    def body(b: Blocked) -> None:
        b.lock = lock
        block_in_c(b)

    return lock, body


def test_a_blocked_call_known_to_sync_is_a_sync_sample_unless_late() -> None:
    lock, body = held_lock()
    with Blocked(body) as b:
        sampler = StackSampler(b.probe, classifier_for(torch))
        if sys.version_info < (3, 11):
            pytest.skip("instructions have source positions from Python 3.11")
        code = block_in_c.__code__
        line = line_of(block_in_c, "b.lock.acquire")
        call = [
            i
            for i in dis.get_instructions(code)
            if i.opname.startswith("CALL") and i.positions.lineno == line
        ][-1]
        sampler.sync_keys[(id(code), call.offset)] = 1
        time.sleep(0.05)
        on_time, late = sampler.sample(), sampler.sample(late=True)
        lock.release()
    # a C function has no frame: it is named as the call site calls it
    assert on_time is not None and on_time.sync and on_time.callee == "b.lock.acquire"
    assert on_time.site.endswith(f"test_why_agent.py:{line} block_in_c")
    assert late is not None and late.late and not late.sync


def test_an_explicit_wait_on_the_device_is_a_sync_sample() -> None:
    """torch.cuda.synchronize / Event.synchronize / Stream.synchronize never warn in a sync window;
    a sample blocked inside one is a wait on the device all the same (here a stand-in, on CPU)."""
    codes = stacks.explicit_syncs(torch)
    assert len(codes) == 3 and {c.co_name for c in codes.values()} == {"synchronize"}
    lock, body = held_lock()
    with Blocked(body) as b:
        sampler = StackSampler(b.probe, classifier_for(torch))
        unknown = sampler.sample()
        sampler.sync_codes = {id(block_in_c.__code__): block_in_c.__code__}
        time.sleep(0.05)
        on_time, late = sampler.sample(), sampler.sample(late=True)
        lock.release()
    assert unknown is not None and not unknown.sync
    assert on_time is not None and on_time.sync
    assert late is not None and not late.sync


@pytest.mark.slow  # among the fast subset's slowest, ~1.8 s here (issue 27: the subset under 60 s)
def test_the_sampler_thread_samples_only_while_attended() -> None:
    def body(b: Blocked) -> None:
        wait_here(b)

    with Blocked(body) as b:
        sampler = StackSampler(b.probe, classifier_for(torch), hz=100.0)
        sampler.start()
        try:
            time.sleep(0.3)
            assert sampler.take() == []
            sampler.attended = True  # seen within QUIET_CHECK_S
            # at the rate the budget allows for their cost (~1 s quiet): dearer on a loaded machine
            deadline = time.monotonic() + 30
            while sampler.samples < 10 and time.monotonic() < deadline:
                time.sleep(0.05)
            got = sampler.take()
        finally:
            sampler.stop()
    assert len(got) >= 10 and all(s.phase == OTHER for s in got)
    # 100 Hz asked; the budget (BUDGET of wall time at its cost a sample) allows what it allows
    assert stacks.MIN_HZ <= sampler.rate <= 100.0
    assert sampler.cost_us is not None and sampler.busy_ns > 0
    assert len(sampler.take(catch_up=True)) >= len(got)  # a joining monitor gets the recent ones again


def test_sys_module_is_untouched() -> None:
    assert sys.getswitchinterval() == pytest.approx(0.005)  # the sampler never tunes the interpreter


def python_work(ms: float) -> int:
    end = time.perf_counter() + ms / 1000
    n = 0
    while time.perf_counter() < end:
        n += 1
    return n


def fake_sync(lock: Any, ms: float) -> None:
    lock.acquire(timeout=ms / 1000)  # blocked in C with the GIL released, as in `loss.item()`


@pytest.mark.slow
def test_the_wait_estimate_does_not_count_the_python_before_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """2 ms of Python, then 4 ms blocked at a known sync: samples due in the Python land at the
    sync too (the sampler gets the GIL there), but late, so they do not count as waiting."""
    monkeypatch.setattr(stacks, "BUDGET", 1.0)  # the estimator, not the sampler's budget, under test
    lock = threading.Lock()
    lock.acquire()
    stop = threading.Event()
    probes: list[Probe] = []

    def train() -> None:
        probes.append(Probe())
        while not stop.is_set():
            python_work(2.0)
            fake_sync(lock, 4.0)

    t = threading.Thread(target=train, daemon=True)
    t.start()
    while not probes:
        time.sleep(0.01)
    s = StackSampler(probes[0], classifier_for(torch), hz=50.0)
    call = [i for i in dis.get_instructions(fake_sync.__code__) if i.opname.startswith("CALL")][-1]
    s.sync_keys[(id(fake_sync.__code__), call.offset)] = 1
    s.attended = True
    s.start()
    time.sleep(4)
    s.stop()
    stop.set()
    t.join(5)
    got = s.take()
    share = sum(x.sync for x in got) / len(got)
    landed = sum("fake_sync" in x.site for x in got) / len(got)
    print(
        f"\n{len(got)} samples: {share:.0%} counted as waiting (4 of 6 ms are), {landed:.0%} landed at the sync"
    )
    assert len(got) >= 50
    assert landed >= 0.8  # the GIL hands the Python's samples to the next place it is let go
    # the Python before the sync only within LATE_NS of it (a sample that late waited for the GIL);
    # counting every sample that landed there would be ~100%. A machine with more runnable threads
    # than cores wakes the sampler late now and then: samples of a real wait left out (an undercount)
    assert 0.1 <= share <= (4 + stacks.LATE_NS / 1e6) / 6 + 0.1
