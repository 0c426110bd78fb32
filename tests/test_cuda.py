"""The agent on a real CUDA training loop: event timing, no synchronization, h2d, the report.

Runs only on a GPU machine (`pytest -m cuda`); everything here is skipped where
`torch.cuda.is_available()` is False. Figures are printed (`-s` or `-rA` shows them) so a run on
the GPU leaves numbers behind, not only a pass.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")

CUDA = torch.cuda.is_available()
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU"),
]

import torchtop.agent  # noqa: E402

TOLERANCE = 0.05  # event timing vs torch.profiler's kernel time


# -- helpers ---------------------------------------------------------------------------------------
@pytest.fixture
def agent(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Any:
    monkeypatch.setenv("TORCHTOP_QUIET", "1")
    monkeypatch.setenv("TORCHTOP_RUNTIME_DIR", str(tmp_path / "run"))
    # the agent enables CUDA events once the user's code initialised CUDA and holds GPU memory
    warm = torch.zeros(1, device="cuda")
    started = torchtop.agent.start()
    assert started is not None, "the agent did not start"
    try:
        _wait(lambda: started.probe.pool is not None, 5.0, "the agent never enabled CUDA events")
        del warm
        yield started
    finally:
        torchtop.agent.stop()


def _wait(cond: Any, timeout: float, message: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(message)
        time.sleep(0.02)


def _client(agent: Any) -> Any:
    from tests.agent_util import client_for

    return client_for(agent)


def _steps_over_wire(agent: Any, last_index: int, timeout: float = 15.0) -> list[Any]:
    """The agent's history read through a real client on loopback, once `last_index` resolved."""
    client = _client(agent)
    try:
        end = time.monotonic() + timeout
        while True:
            reply, steps = client.snapshot()
            assert reply.ok, reply.error
            assert client.replay.failures == 0, "the monitor could not replay the log"
            if steps and steps[-1].i >= last_index:
                return list(steps)
            if time.monotonic() > end:
                got = steps[-1].i if steps else None
                raise AssertionError(f"step {last_index} never resolved (last resolved: {got})")
            time.sleep(0.1)
    finally:
        client.close()


class MatmulChain(torch.nn.Module):
    """Forward is nothing but a chain of large matmuls: its kernels are unambiguous in a profile."""

    def __init__(self, dim: int, depth: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(dim, dim, bias=False) for _ in range(depth))

    def forward(self, x: Any) -> Any:
        for layer in self.layers:
            x = layer(x)
        return x


def _mlp(width: int = 512, depth: int = 4) -> Any:
    layers: list[Any] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers).cuda()


# -- (a) event timing vs torch.profiler ------------------------------------------------------------
@pytest.mark.cuda
def test_event_timing_matches_profiler_kernel_time(agent: Any) -> None:
    """The agent's CUDA-event forward time is within 5% of the profiler's forward kernel time.

    The profiler runs over the same steps as the agent (concurrently), so both measure the very
    same kernels: no run-to-run variation (clocks, cache state) enters the comparison. CUPTI's
    tracing slows kernel *launches* on the host, but the GPU time of large matmuls is unchanged,
    and the host runs far ahead of the GPU here (a few launches for ~15 ms of GPU work a step),
    so the stream never idles between the forward's start and end events. The first profiled
    step is left out: the device is idle at its start (we synchronised before starting the
    profiler), so its event interval would include launch latency that no kernel accounts for.

    Which kernels are the forward's is read off the stream order, not off the profiler's
    kernel-to-op links: the forward launches one GEMM per layer and nothing else, so on the one
    stream each step's forward is a run of exactly `depth` consecutive GEMMs between the
    optimizer's and the loss's elementwise kernels (the backward's run is 2*depth-1 long). On
    torch 2.11 + H100 the op links (a record_function's kernels) put a backward GEMM under the
    forward in about half of the steps (+1.3 ms); the stream order has no such ambiguity.
    """
    from torch.autograd import DeviceType  # pyright: ignore[reportPrivateImportUsage]  # torch re-exports it
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    dim, batch, depth = 4096, 2048, 4
    model = MatmulChain(dim, depth).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    x = torch.randn(batch, dim, device="cuda") / dim**0.5

    def step(sync: bool = False) -> None:
        out = model(x)
        loss = out.square().mean()  # functional: no second root module inside "forward"
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sync:  # warm-up only: makes the host step time the GPU time, so the stride settles
            torch.cuda.synchronize()

    probe = agent.probe
    resolver = agent.loop.resolver
    # Warm up (synchronised steps: the host step time is the GPU's) until enough event steps
    # resolved that the stride, a median over the last 64 samples, stays small through the
    # window's first steps, whose host time is short while the launch queue fills.
    end = time.monotonic() + 30
    while time.monotonic() < end:
        step(sync=True)
        if resolver.event_steps >= 40:
            break
    torch.cuda.synchronize()

    n = 121
    i0 = probe.steps  # the step now open is the first profiled one (steps are contiguous)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
    # (prof's exit synchronised: every event of the window has completed)
    events = prof.events()
    assert events is not None  # a finished profile has its events

    kernels = sorted(
        (
            e
            for e in events
            if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
        ),
        key=lambda e: e.time_range.start,
    )
    # maximal runs of consecutive GEMMs: each step's forward is one run of `depth` (after the
    # optimizer's elementwise kernels, before the loss's); the backward's run is 2*depth-1 long
    runs: list[list[Any]] = [[]]
    for e in kernels:
        if "gemm" in e.name.lower():
            runs[-1].append(e)
        elif runs[-1]:
            runs.append([])
    runs = [r for r in runs if r]
    print(
        f"\n[cuda timing] {len(kernels)} device kernels; GEMM run lengths {sorted({len(r) for r in runs})}; "
        f"first kernels: {[e.name[:50] for e in kernels[: depth + 3]]}"
    )
    forwards = [r for r in runs if len(r) == depth]
    assert len(forwards) == n, (
        f"found {len(forwards)} forward GEMM runs for {n} steps: {[len(r) for r in runs]}"
    )
    fwd_us = {k: sum(e.time_range.elapsed_us() for e in r) for k, r in enumerate(forwards)}
    all_kernels_us = sum(e.time_range.elapsed_us() for e in kernels)

    steps = {s.i: s for s in _steps_over_wire(agent, i0 + n - 1)}
    window = [steps[i] for i in range(i0 + 1, i0 + n) if i in steps]
    evented = [s for s in window if s.device_ms]
    print(
        f"[cuda timing] window {i0 + 1}..{i0 + n - 1}: {len(window)} steps, {len(evented)} event steps, "
        f"stride {probe.event_every}, pool misses {agent.loop.resolver.pool.misses}"
    )
    assert len(evented) >= 3, f"only {len(evented)} event steps in the window (stride {probe.event_every})"
    assert all("forward" in s.device_ms for s in evented), [s.device_ms for s in evented]

    prof_fwd_ms = sum(fwd_us[s.i - i0] for s in evented) / len(evented) / 1000
    ev_fwd_ms = sum(s.device_ms["forward"] for s in evented) / len(evented)
    prof_step_ms = all_kernels_us / n / 1000  # every step launches the same kernels
    ev_step_ms = sum(s.device_ms["step"] for s in evented) / len(evented)
    per_step = ", ".join(
        f"{s.i - i0}:{s.device_ms['forward']:.3f}/{fwd_us[s.i - i0] / 1000:.3f}" for s in evented
    )
    print(
        f"[cuda timing] forward: events {ev_fwd_ms:.4f} ms, profiler kernels {prof_fwd_ms:.4f} ms "
        f"({ev_fwd_ms / prof_fwd_ms - 1:+.2%})"
    )
    print(
        f"[cuda timing] step:    events {ev_step_ms:.4f} ms, profiler kernels {prof_step_ms:.4f} ms "
        f"({ev_step_ms / prof_step_ms - 1:+.2%})"
    )
    print(f"[cuda timing] per event step (events/profiler ms): {per_step}")
    print(f"[cuda timing] device_ms of one step: {evented[-1].device_ms}")
    assert abs(ev_fwd_ms / prof_fwd_ms - 1) <= TOLERANCE
    assert abs(ev_step_ms / prof_step_ms - 1) <= TOLERANCE
    for s in evented:  # and each event step against the same step's kernels
        assert abs(s.device_ms["forward"] / (fwd_us[s.i - i0] / 1000) - 1) <= TOLERANCE, per_step


# -- (c) host-to-device copies -------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("how", ["to", "cuda", "copy_"])
def test_h2d_is_attributed(agent: Any, how: str) -> None:
    """A CPU batch moved to the GPU is h2d: host time on every step, device time on event steps."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    cpu_batch = torch.randn(1024, 512)  # 2 MiB, pageable
    buf = torch.empty(1024, 512, device="cuda")
    i0 = agent.probe.steps
    n = 0
    end = time.monotonic() + 2.0
    while time.monotonic() < end or n < 50:
        if how == "to":
            x = cpu_batch.to("cuda")
        elif how == "cuda":
            x = cpu_batch.cuda()
        else:
            x = buf.copy_(cpu_batch)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        n += 1
    steps = [s for s in _steps_over_wire(agent, i0 + n - 1) if i0 < s.i < i0 + n]
    evented = [s for s in steps if s.device_ms]
    h2d_host = sorted(s.phases["h2d"] for s in steps)
    print(
        f"\n[h2d {how}] {len(steps)} steps, {len(evented)} event steps; host h2d median "
        f"{h2d_host[len(h2d_host) // 2] / 1e6:.4f} ms; device h2d "
        f"{[round(s.device_ms.get('h2d', -1), 4) for s in evented[:8]]}"
    )
    # the first step of a fresh agent opens at the forward, after the copy: it is left out
    assert all(s.phases["h2d"] > 0 for s in steps), "a step without host h2d time"
    assert all(s.phases["h2d"] <= s.wall_ns for s in steps)
    assert evented, "no event step"
    assert all(s.device_ms.get("h2d", 0) > 0 for s in evented), [s.device_ms for s in evented]
    assert agent.probe.failures == 0


@pytest.mark.cuda
def test_h2d_wrappers_stay_out_of_a_fullgraph_compile_on_gpu(agent: Any) -> None:
    """A model's `.to(dtype)` and GPU-to-GPU `copy_` inside a fullgraph compile, with the h2d
    wrappers in place: they must trace without a graph break (an error under fullgraph=True)."""
    assert torch.Tensor.to is not torch._C.TensorBase.to

    @torch.compile(backend="eager", fullgraph=True)
    def f(x: Any, buf: Any) -> Any:
        buf.copy_(x)
        return x.to(torch.float16).float() * 2 + buf + x.cuda()

    x = torch.ones(8, device="cuda")
    assert f(x, torch.zeros(8, device="cuda")).tolist() == [4.0] * 8
    assert agent.probe.failures == 0


# -- (d) the report ------------------------------------------------------------------------------
@pytest.mark.cuda
def test_report_says_cuda(agent: Any) -> None:
    """`torchtop report` (a separate process, over loopback) on a CUDA run says device "cuda"."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(256, 512, device="cuda")
    code = "import sys; from torchtop.monitor.commands.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "report", str(agent.pid), "--seconds", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    end = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < end:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    report = json.loads(out)
    print(
        f"\n[report] device {report['device']!r} ({report.get('device_name')}), {report['steps']} steps, "
        f"step {report['step_time_ms']}, device_ms {report.get('device_ms')}"
    )
    assert report["device"] == "cuda"
    assert report["device_name"]
    assert report["steps"] > 0
    assert "forward" in report["device_ms"] and report["device_ms"]["forward"] > 0


# -- (b) no synchronisation on the training thread -----------------------------------------------
# Last in this file on purpose: once activated, the GPU trace cannot be turned off in-process, and
# callbacks cannot be unregistered; ours only record while `_SYNCS` is armed.
_SYNCS: list[tuple[str, int]] = []
_ARMED = threading.Event()
_TRACE_ON = False


def _activate_sync_trace() -> None:
    global _TRACE_ON
    if _TRACE_ON:
        return
    from torch.cuda import _gpu_trace

    def note(kind: str) -> Any:
        def cb(*_: Any) -> None:
            if _ARMED.is_set():
                _SYNCS.append((kind, threading.get_ident()))

        return cb

    torch._C._activate_gpu_trace()
    _gpu_trace.register_callback_for_device_synchronization(note("device"))
    _gpu_trace.register_callback_for_stream_synchronization(note("stream"))
    _gpu_trace.register_callback_for_event_synchronization(note("event"))
    _TRACE_ON = True


@pytest.mark.cuda
def test_no_sync_on_training_thread(agent: Any) -> None:
    """A CUDA loop with the agent running synchronises nothing: not the training thread, not the agent's.

    Two nets, each verified to catch a sync before it is trusted: the GPU trace callbacks (which
    see every device/stream/event synchronisation, `torch.cuda.synchronize()` included) and
    `set_sync_debug_mode("error")` (which raises on `.item()`, D2H copies, stream syncs). The
    loop itself is written without a sync: pinned memory and `non_blocking=True` copies.
    """
    me = threading.get_ident()
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    data = torch.utils.data.TensorDataset(torch.randn(4096, 512), torch.randn(4096, 512))
    loader = torch.utils.data.DataLoader(data, batch_size=128, shuffle=True, pin_memory=True)

    # controls: each net catches a deliberate sync. (With the GPU trace active, torch 2.11
    # reports the sync-debug error as "SystemError: error return without exception set".)
    probe = torch.ones(1, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises((RuntimeError, SystemError)):
            probe.sum().item()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _activate_sync_trace()
    _SYNCS.clear()
    _ARMED.set()
    torch.cuda.synchronize()
    _ARMED.clear()
    assert ("device", me) in _SYNCS, f"the GPU trace missed torch.cuda.synchronize(): {_SYNCS}"

    def failures() -> int:
        return agent.probe.failures

    i0 = agent.probe.steps
    failures0, errors0 = failures(), agent.loop.errors
    n = 0
    _SYNCS.clear()
    torch.cuda.set_sync_debug_mode("error")
    _ARMED.set()
    try:
        end = time.monotonic() + 2.5  # several agent ticks: events resolved, pool topped up, telemetry
        while time.monotonic() < end:
            for xb, yb in loader:
                x = xb.to("cuda", non_blocking=True)
                y = yb.to("cuda", non_blocking=True)
                loss = (model(x) - y).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                n += 1
    finally:
        _ARMED.clear()
        torch.cuda.set_sync_debug_mode("default")
    syncs = list(_SYNCS)
    agent_thread = agent.loop.ident
    names = {t.ident: t.name for t in threading.enumerate()}
    print(
        f"\n[no sync] {n} steps; sync callbacks: {[(k, names.get(t, t)) for k, t in syncs]}; "
        f"agent errors {agent.loop.errors - errors0}, hook failures {failures() - failures0}"
    )
    assert not [s for s in syncs if s[1] == me], f"the training thread synchronised: {syncs}"
    assert not [s for s in syncs if s[1] == agent_thread], f"the agent thread synchronised: {syncs}"
    assert failures() == failures0, "a hook failed under sync-debug mode"
    assert agent.loop.errors == errors0, "the agent thread raised under sync-debug mode"

    # the loop really was measured: event steps with device time, and h2d seen
    steps = [s for s in _steps_over_wire(agent, i0 + n - 1) if i0 < s.i < i0 + n]
    evented = [s for s in steps if s.device_ms]
    assert evented and all("forward" in s.device_ms and "h2d" in s.device_ms for s in evented)
    assert all(s.phases["h2d"] > 0 for s in steps)
