"""Sync windows and the one-step FLOP count, on CPU.

A sync window needs CUDA's sync debug mode: here it runs on a stand-in for `torch.cuda` that has
the mode's two functions, and the synchronising call is a warning with torch's message raised at
a known line (what torch's warning handler does on CUDA). On a real GPU: tests/test_why_cuda.py.
"""

from __future__ import annotations

import dis
import sys
import threading
import time
import warnings
from types import SimpleNamespace
from typing import Any

import pytest

from tests.agent_util import client_for
from tests.test_why_agent import line_of
from torchtop.agent.hooks.frames import classifier_for
from torchtop.agent.hooks.probe import Probe
from torchtop.agent.hooks.sync_window import MESSAGE, SyncWindow, call_name
from torchtop.agent.hooks.timed import timed
from torchtop.agent.telemetry.stacks import StackSampler
from torchtop.contract.logcodes import H2D

torch = pytest.importorskip("torch")


# -- sync windows ------------------------------------------------------------------------------------
class FakeCuda:
    """`torch.cuda`'s sync debug mode, without CUDA."""

    def __init__(self, mode: int = 0) -> None:
        self.mode = mode

    def get_sync_debug_mode(self) -> int:
        return self.mode

    def set_sync_debug_mode(self, mode: int) -> None:
        self.mode = mode


def a_sync(loss: Any) -> None:
    warnings.warn(MESSAGE + " (Triggered internally at CUDAFunctions.cpp:1.)", UserWarning, stacklevel=1)


def test_a_window_finds_the_call_and_prints_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    probe = Probe(thread_id=threading.get_ident())
    sampler = StackSampler(probe, classifier_for(torch))
    fake = SimpleNamespace(cuda=FakeCuda())
    w = SyncWindow(fake, probe, sampler.classifier, sampler.sync_keys)
    before = (warnings.showwarning, list(warnings.filters))
    assert w.open() and fake.cuda.mode == 1
    for _ in range(3):
        a_sync(None)
    other = threading.Thread(target=a_sync, args=(None,))  # another thread's sync: not the loop's
    other.start()
    other.join()
    probe._steps, probe.left = 3, probe._batch  # three steps went by
    w.close()
    assert fake.cuda.mode == 0 and (warnings.showwarning, warnings.filters) == before
    assert w.seen == 3 and w.windows == 1 and len(w.sites) == 1
    (site,) = w.described()
    assert site.site.endswith(f"test_why_sync_flops.py:{line_of(a_sync, 'warnings.warn')} a_sync")
    assert site.call == "warnings.warn()"
    assert site.calls == 3 and site.steps == 3 and "warnings.warn(MESSAGE" in site.line
    assert len(sampler.sync_keys) == 1
    assert MESSAGE not in capsys.readouterr().err
    a_sync(None) if False else None  # noqa: B018 - outside a window the warning would be the user's again


def test_a_sync_inside_a_wrapper_of_ours_is_the_users_call() -> None:
    """A pageable `.to()` synchronises inside torchtop's h2d wrapper: the site is the user's
    line, and nothing of torchtop's is named."""
    probe = Probe(thread_id=threading.get_ident())
    classifier = classifier_for(torch)
    w = SyncWindow(SimpleNamespace(cuda=FakeCuda()), probe, classifier, {})
    to = timed(probe, H2D, warnings.warn)  # a C call made from our wrapper's frame, as orig_to is
    assert w.open()
    to(MESSAGE, UserWarning)  # the user's call
    w.close()
    (site,) = w.described()
    assert site.site.endswith(f"{test_a_sync_inside_a_wrapper_of_ours_is_the_users_call.__name__}")
    assert site.via == "" and site.call == "to()"


def test_a_window_leaves_a_users_own_mode_alone() -> None:
    probe = Probe(thread_id=threading.get_ident())
    fake = SimpleNamespace(cuda=FakeCuda(mode=2))
    w = SyncWindow(fake, probe, classifier_for(torch), {})
    assert not w.open() and "set torch.cuda.set_sync_debug_mode() itself" in w.reason
    assert fake.cuda.mode == 2


def test_closing_keeps_a_mode_the_run_set_meanwhile() -> None:
    probe = Probe(thread_id=threading.get_ident())
    fake = SimpleNamespace(cuda=FakeCuda())
    w = SyncWindow(fake, probe, classifier_for(torch), {})
    assert w.open()
    fake.cuda.mode = 2  # the user's own "error" mode, set during the window
    w.close()
    assert fake.cuda.mode == 2


def test_other_warnings_still_reach_the_user_during_a_window() -> None:
    probe = Probe(thread_id=threading.get_ident())
    w = SyncWindow(SimpleNamespace(cuda=FakeCuda()), probe, classifier_for(torch), {})
    shown: list[str] = []
    old = warnings.showwarning
    warnings.showwarning = lambda m, *a, **k: shown.append(str(m))  # type: ignore[assignment]
    try:
        assert w.open()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = w._showwarning  # catch_warnings restored the module's; ours again
            warnings.warn("the user's own warning", UserWarning, stacklevel=1)
        w.close()
    finally:
        warnings.showwarning = old
    assert shown == ["the user's own warning"]


def calls(loss: Any, x: Any, mask: Any, m: Any) -> None:
    loss.item()
    print(x)
    y = x[mask]
    x.cpu()
    torch.nonzero(m)
    print(f"loss {loss.item():.4f}")
    return y


@pytest.mark.parametrize(
    ("text", "name"),
    [
        ("loss.item()", "loss.item()"),
        ("print(x)", "print()"),
        ("y = x[mask]", "x[mask]"),
        ("x.cpu()", "x.cpu()"),
        ("torch.nonzero(m)", "torch.nonzero()"),
        ('print(f"loss', "loss.item()"),  # the innermost call of that line, not the print
    ],
)
def test_call_name(text: str, name: str) -> None:
    if sys.version_info < (3, 11):
        pytest.skip("instructions have source positions from Python 3.11")
    code = calls.__code__
    line = line_of(calls, text)
    ops = [i for i in dis.get_instructions(code) if i.positions and i.positions.lineno == line]
    op = [i for i in ops if i.opname.startswith("CALL") or "SUBSCR" in i.opname]
    target = op[0] if text.startswith("print(f") else op[-1]
    assert call_name(code, target.offset) == name


# -- the FLOP count ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_flops_of_one_step_are_counted_and_that_step_kept_out(agent: Any) -> None:
    """A bias-free matmul chain on CPU: the count is the closed form, samples the batch rows."""
    from torchtop.demos.known_flops import build, flops_per_step, step
    from torchtop.monitor.model.state import RunState

    torch.set_num_threads(1)
    model, x = build(torch.device("cpu"), 64, 128, depth=4)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    client = client_for(agent)
    state = RunState()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        step(model, opt, x)
        for got in client.recv_batches(0.0):
            state.apply_batch(got.batch, got.steps, time.monotonic())
        f = state.why.flops
        if f is not None and f.state == "done" and len(state.steps) > 30:
            break
    client.close()
    f = state.why.flops
    assert f is not None and f.state == "done", f
    assert f.flops == flops_per_step(64, 128, 4) and f.by_dtype == {"float32": f.flops}
    assert f.samples == 64 and f.tokens is None and f.input_shape == [64, 128]
    assert f.cost_ms is not None and f.cost_ms > 0
    assert sum(state.why.excluded(s) for s in state.steps) == 2  # the counted step and the next
    assert not any(state.why.excluded(s) for s in state.window(60.0))
    assert agent.probe.on_step is None and agent.probe.failures == 0


@pytest.mark.slow
def test_the_roots_parameters_are_counted_once_and_reach_the_monitor(agent: Any) -> None:
    """Issue 35 item 6: the modules the loop calls, their parameters counted on the agent thread
    (a pipeline stage's work); a weight shared by two roots counts once."""
    from torchtop.monitor.model.state import RunState

    torch.set_num_threads(1)
    shared = torch.nn.Linear(16, 16)
    head = torch.nn.Sequential(shared, torch.nn.Linear(16, 4))
    aux = torch.nn.Sequential(shared, torch.nn.Linear(16, 2))
    opt = torch.optim.SGD([*head.parameters(), *aux.parameters()], lr=1e-3)
    x = torch.randn(8, 16)
    client = client_for(agent)
    state = RunState()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and state.why.params is None:
        (head(x).sum() + aux(x).sum()).backward()
        opt.step()
        opt.zero_grad()
        for got in client.recv_batches(0.0):
            state.apply_batch(got.batch, got.steps, time.monotonic())
    client.close()
    assert state.why.params == 16 * 16 + 16 + (16 * 4 + 4) + (16 * 2 + 2), state.why.params


def test_a_capture_waits_while_the_flop_count_runs() -> None:
    """Asked for during the counted step, a capture is accepted and armed at the first tick after
    that step: nobody is told to ask again for an internal one-step job."""
    from torchtop.agent.capture.controller import CaptureController
    from torchtop.agent.cuda_use import CudaUse
    from torchtop.agent.hooks.flop_step import HOOK
    from torchtop.agent.hooks.step_hooks import Order

    probe = Probe(thread_id=threading.get_ident())
    hooks = probe.hooks

    def counting() -> None:
        pass

    assert hooks.register(HOOK, counting, Order.FLOP_COUNT) and hooks.open(HOOK, counting)  # its step runs
    c = CaptureController(CudaUse(torch), probe)
    info = c.request("capture-profile", {"steps": 2})
    assert info.state == "pending" and hooks.names() == [HOOK]  # the count keeps its boundary
    c.poll()
    assert hooks.names() == [HOOK]
    hooks.unregister(HOOK, counting)  # the counted step ended (FlopStep._exit)
    c.poll()
    assert hooks.names() == ["capture"]  # armed: the next boundary starts the capture
    c.close()
    assert probe.on_step is None
    assert hooks.register(
        HOOK, counting, Order.FLOP_COUNT
    )  # a count armed only: the capture takes the boundary
    c2 = CaptureController(CudaUse(torch), probe)
    assert c2.request("capture-profile", {"steps": 2}).state == "pending"
    assert hooks.names() == ["capture"] and not hooks.holds(HOOK)
    assert not hooks.register(HOOK, counting, Order.FLOP_COUNT)  # and no count while it holds the step
    c2.close()


def _counted(model: Any, one_step: Any) -> Any:
    """One step under FlopStep, as the probe's boundaries drive it: its FlopResult."""
    from torchtop.agent.hooks.flop_step import FlopStep

    results: list[Any] = []
    probe = Probe()
    counting = FlopStep(torch, probe, lambda: [model], results.append)
    assert counting.arm() and probe.on_step is not None
    probe.on_step()  # a boundary: enter the counter
    one_step()
    probe.on_step()  # the next: leave it
    assert probe.on_step is None  # done: nothing left on the hot path
    (result,) = results
    assert not result.error, result.error
    return result


def test_the_flop_count_leaves_out_work_outside_the_model() -> None:
    """A generator's preprocessing matmul between steps is the loop's work, not the model's."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 8, bias=False))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = torch.randn(512, 64)

    def one_step() -> None:
        x = torch.randn(32, 512) @ w  # preprocessing: 2*32*512*64 FLOPs, 5x the model's
        model(x).sum().backward()
        opt.step()

    result = _counted(model, one_step)
    forward = 2 * 32 * 64 * 64 + 2 * 32 * 64 * 8
    assert result.flops == 3 * forward - 2 * 32 * 64 * 64  # backward: both grads but the input's
    assert sum(result.by_dtype.values()) <= result.flops and result.samples == 32


def test_samples_of_a_time_major_batch_count_its_batch_not_its_steps() -> None:
    """word_language_model's shape: (35, 20) token ids into an LSTM with batch_first=False."""

    class Rnn(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(100, 16)
            self.rnn = torch.nn.LSTM(16, 16)  # batch_first=False: (T, B, ...)
            self.out = torch.nn.Linear(16, 100)

        def forward(self, x: Any) -> Any:
            return self.out(self.rnn(self.embed(x))[0])

    model = Rnn()
    tokens = torch.randint(0, 100, (35, 20))
    result = _counted(model, lambda: model(tokens).sum().backward())
    assert result.samples == 20 and result.tokens == 35 * 20
    first = torch.nn.Sequential(torch.nn.Linear(8, 4))  # no such layer: the first dimension
    assert _counted(first, lambda: first(torch.randn(6, 8)).sum().backward()).samples == 6
