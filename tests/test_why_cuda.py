"""Why on a real GPU: the sync verdict names `loss.item()`, host-code on CUDA, MFU against the
test's own clock, and sync windows that add no synchronisation of their own.

Runs only on a GPU machine (`pytest -m cuda`). Figures are printed (`-s`): a run leaves numbers.
"""

from __future__ import annotations

import inspect
import re
import threading
import time
from typing import Any

import pytest

from tests.test_why_scenarios import lines_of, run_demo

torch = pytest.importorskip("torch")

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]

import torchtop.agent  # noqa: E402
from torchtop.agent.telemetry import stacks  # noqa: E402
from torchtop.demos import host_code, known_flops, sync_stall  # noqa: E402


def ours(where: str) -> bool:
    """A site or callee in torchtop's agent or monitor (its demos are the user's code here)."""
    import os

    import torchtop.agent
    import torchtop.monitor

    dirs = [os.path.dirname(m.__file__ or "") for m in (torchtop.agent, torchtop.monitor)]
    return any(d in where for d in dirs) or where.startswith(("torchtop.agent", "torchtop.monitor"))


def item_line() -> int:
    src, first = inspect.getsourcelines(sync_stall.main)
    return first + next(k for k, line in enumerate(src) if "loss.item()" in line)


# -- the demos, as a user would see them -----------------------------------------------------------
@pytest.mark.slow
def test_cuda_sync_stall_names_the_item_call_within_10_s() -> None:
    r = run_demo("sync_stall", "cuda", warm_s=4, report_s=6, first_step=True)
    v = r["verdict"]
    assert v["kind"] == "sync" and v["severity"] in ("warning", "critical"), v
    assert f"`loss.item()` at sync_stall.py:{item_line()} main waits" in v["evidence"][0], v["evidence"]
    assert v["upside"] and v["upside"]["kind"] == "estimate" and v["upside"]["speedup"] > 1.2
    calls = {s["call"]: s for s in r["sync"]["sites"]}
    # the pageable `.to(device)` copies synchronise too (torch waits for them): found, barely waited on
    site = calls["loss.item()"]
    assert site["calls_per_step"] == pytest.approx(1.0, abs=0.1)
    assert site["wait_ms_per_step"] == max(s["wait_ms_per_step"] or 0 for s in r["sync"]["sites"])
    assert not [s for s in r["sync"]["sites"] if ours(s["site"]) or ours(s["via"] or "")]
    assert r["sync"]["wait_ms_per_step"] > 0.3 * r["step_time_ms"]["mean"]
    assert r["sync"]["cost_us_per_sync"] is not None


@pytest.mark.slow
def test_cuda_host_code_names_log_metrics_within_10_s() -> None:
    r = run_demo("host_code", "cuda", warm_s=4, report_s=6, first_step=True)
    v = r["verdict"]
    assert v["kind"] == "host-code", v
    m = re.search(r"host_code\.py:(\d+) (\S+)", " ".join(v["evidence"]))
    assert m and "log_metrics" in m.group(2) and int(m.group(1)) in lines_of(host_code.MetricsLog.log_metrics)


@pytest.mark.slow
def test_cuda_known_flops_is_compute_bound_with_its_mfu_within_10_s() -> None:
    r = run_demo("known_flops", "cuda", warm_s=2, report_s=6, first_step=True)
    t = r["throughput"]
    sizes = known_flops.CUDA
    assert r["verdict"]["kind"] == "compute", r["verdict"]
    assert t["flops_per_step"] == known_flops.flops_per_step(sizes.batch_size, sizes.width, known_flops.DEPTH)
    assert t["precision"] == "bf16" and t["mfu"] is not None and 0.2 <= t["mfu"] <= 1.0, t
    assert any(e.startswith("MFU ") for e in r["verdict"]["evidence"]), r["verdict"]["evidence"]
    up = r["verdict"]["upside"]
    assert up and up["kind"] == "bound" and up["new_step_ms"] < up["step_ms"], up


# -- in process ---------------------------------------------------------------------------------------
@pytest.fixture
def agent(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Any:
    monkeypatch.setenv("TORCHTOP_RUNTIME_DIR", str(tmp_path / "run"))
    warm = torch.zeros(1, device="cuda")  # CUDA in use before start(): events from the first ticks
    started = torchtop.agent.start()
    assert started is not None
    try:
        yield started
        del warm
    finally:
        torchtop.agent.stop()


class Feed:
    """A monitor on the agent in this process, applying what it receives to a RunState."""

    def __init__(self, agent: Any) -> None:
        from tests.agent_util import endpoint_for
        from torchtop.monitor.link.client import AgentClient
        from torchtop.monitor.model.state import RunState

        self.client = AgentClient(endpoint_for(agent))
        self.state = RunState()
        self.state.apply_hello(self.client.hello())

    def poll(self) -> None:
        for got in self.client.recv_batches(0.0):
            self.state.apply_batch(got.batch, got.steps, time.monotonic())

    def count_flops(self, step: Any, timeout: float = 120.0) -> Any:
        """Train with `step()` until the agent's one-step FLOP count has an outcome; that FlopInfo."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            step()
            self.poll()
            f = self.state.why.flops
            if f is not None and f.state in ("done", "failed", "off"):
                break
        return self.state.why.flops

    def close(self) -> None:
        self.client.close()


def test_mfu_agrees_with_the_tests_own_clock(agent: Any) -> None:
    """A large bf16 matmul chain: the agent's achieved TFLOP/s (its FLOP count over one step ÷ its
    step times) against the closed-form FLOPs ÷ the GPU time the test measures with its own
    events over the same steps, in the steady state where the host waits on a full queue."""
    from torchtop.monitor.diagnosis.throughput import throughput

    batch, width, depth = 8192, 8192, 8
    model, x = known_flops.build(torch.device("cuda"), batch, width, depth)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    feed = Feed(agent)
    try:
        f = feed.count_flops(lambda: known_flops.step(model, opt, x))
        assert f is not None and f.state == "done", f
        for _ in range(40):  # the launch queue fills: the host now runs at the GPU's pace
            known_flops.step(model, opt, x)
            feed.poll()
        n = 100
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ev0.record()
        wall0 = time.time()
        for _ in range(n):
            known_flops.step(model, opt, x)
            feed.poll()
        wall1 = time.time()
        ev1.record()
        ev1.synchronize()  # the test's own sync, after the measured steps
        gpu_s = ev0.elapsed_time(ev1) / 1e3
        stop = time.monotonic() + 2
        while time.monotonic() < stop:
            feed.poll()
            time.sleep(0.05)
        steps = [
            s
            for s in feed.state.steps
            if wall0 <= s.t0 and s.t0 + s.wall_ns / 1e9 <= wall1 and s.kind == "train"
        ]
        t = throughput(steps, f, feed.state.hello.device_name if feed.state.hello else "")
    finally:
        feed.close()
    closed_form = known_flops.flops_per_step(batch, width, depth)
    own = closed_form * n / gpu_s / 1e12
    print(
        f"\n[mfu] counted {f.flops / 1e12:.3f} TFLOP a step (closed form {closed_form / 1e12:.3f}); "
        f"agent {t.achieved_tflops:.1f} TFLOP/s over {len(steps)} steps, MFU {t.mfu} ({t.peak_from}); "
        f"test's own clock {own:.1f} TFLOP/s over {n} steps ({gpu_s * 1e3 / n:.2f} ms a step on the GPU)"
    )
    assert f.flops == closed_form and f.by_dtype == {"bfloat16": closed_form}
    assert len(steps) >= n // 2
    assert t.achieved_tflops == pytest.approx(own, rel=0.10)
    if t.mfu is not None:
        assert t.mfu == pytest.approx(own / t.peak_tflops, rel=0.10)


def test_float32_convolutions_are_counted_at_tf32_as_cudnn_runs_them(agent: Any) -> None:
    """cuDNN runs float32 convolutions in TF32 unless told not to (torch.backends.cudnn.allow_tf32):
    a float32 CNN's MFU is against the TF32 peak, never above 100% of the float32 one."""
    from torchtop.monitor.diagnosis.throughput import throughput

    assert torch.backends.cudnn.allow_tf32  # torch's default
    model = torch.nn.Sequential(
        torch.nn.Conv2d(64, 256, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(256, 256, 3, padding=1)
    ).cuda()
    x = torch.randn(64, 64, 56, 56, device="cuda")
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    feed = Feed(agent)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    try:
        feed.count_flops(step)
        for _ in range(30):
            step()
            feed.poll()
        time.sleep(1.5)
        feed.poll()
        f = feed.state.why.flops
        assert f is not None and f.state == "done", f
        steps = [s for s in feed.state.steps if s.kind == "train"][5:]
        t = throughput(steps, f, feed.state.hello.device_name if feed.state.hello else "")
    finally:
        feed.close()
    print(
        f"\n[conv tf32] by dtype {f.by_dtype}; {t.achieved_tflops:.1f} TFLOP/s, MFU {t.mfu} ({t.peak_from})"
    )
    assert max(f.by_dtype, key=lambda k: f.by_dtype[k]) == "tf32", f.by_dtype
    assert t.precision == "tf32"
    if t.mfu is not None:
        assert 0 < t.mfu <= 1.0


def test_a_sync_window_finds_print_of_a_tensor_and_adds_no_sync_of_its_own(agent: Any) -> None:
    """A loop that prints its loss tensor: the window names the print's line (the sync happens
    inside torch's tensor formatting) and nothing of torchtop's own; a loop with no sync finds none."""
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(4)]).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(1024, 2048, device="cuda")
    why = agent.why
    printed: list[str] = []

    def loop(with_print: bool) -> None:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if with_print:
            printed.append(str(loss))  # the sync: formatting a CUDA tensor reads it

    end = time.monotonic() + 30
    while why.window is None or why.window.windows < 1:
        loop(with_print=True)
        assert time.monotonic() < end, f"no sync window ran: {why.sync_state} {why.sync_reason}"
    sites = why.window.described()
    print(
        f"\n[sync window] {[(s.site, s.call, s.via, s.calls, s.steps) for s in sites]}, {why.sync_info().cost_us} us a sync"
    )
    line = inspect.getsourcelines(loop)[1] + next(
        k for k, text in enumerate(inspect.getsourcelines(loop)[0]) if "str(loss)" in text
    )
    assert sites and sites[0].site.endswith(f"test_why_cuda.py:{line} {loop.__qualname__}")
    assert sites[0].via.startswith("torch.")
    assert not [s for s in sites if "torchtop" in s.site or "torchtop" in s.via]
    # without the print the loop synchronises nothing: a second window (they open again while a
    # monitor listens) finds nothing new, so the agent added no sync of its own either
    before = sum(s.calls for s in why.window.sites.values())
    why._next_window = 0.0
    feed = Feed(agent)
    try:
        end = time.monotonic() + 30
        windows = why.window.windows
        while why.window.windows == windows:
            loop(with_print=False)
            feed.poll()
            assert time.monotonic() < end, "the second window never ran"
    finally:
        feed.close()
    assert sum(s.calls for s in why.window.sites.values()) == before


def test_the_stack_sampler_reads_a_cuda_loop_without_touching_cuda(agent: Any) -> None:
    """The sampler thread holds no CUDA call: sampling a launch-bound loop while another thread
    runs `set_sync_debug_mode("error")` raises nothing anywhere. A monitor listens (the agent
    samples only then) and receives the samples."""
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)]).cuda()
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(32, 256, device="cuda")
    feed = Feed(agent)
    errors0 = agent.loop.errors
    seconds = 5.0
    try:
        deadline = time.monotonic() + 30
        while not agent.why.sampler.attended and time.monotonic() < deadline:
            time.sleep(0.05)
        torch.cuda.set_sync_debug_mode("error")
        try:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                feed.poll()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        time.sleep(1.0)
        feed.poll()
        got = [s for _, s in feed.state.why.samples]
    finally:
        feed.close()
    sampler = agent.why.sampler
    print(
        f"\n[sampler] {len(got)} samples in {seconds:g} s, at {sampler.rate:.1f} Hz now, "
        f"{sampler.cost_us} us a sample; thread {threading.active_count()}"
    )
    # at least MIN_HZ whatever a sample costs on this host (the rate backs off to stay in budget)
    assert len(got) >= seconds * stacks.MIN_HZ * 0.8 and agent.loop.errors == errors0
    assert {s.phase for s in got} & {2, 3, 4}  # forward, backward, optimizer seen


class Elementwise(torch.nn.Module):
    """A small linear layer, then long elementwise work on a big tensor: the GPU is always
    running a kernel (NVML ~100%) that does almost no matmul FLOPs."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(1024, 1024)
        self.scale = torch.nn.Parameter(torch.ones(1))

    def forward(self, x: Any, big: Any) -> Any:
        for _ in range(20):
            big = big * self.scale + 0.5
        return self.head(x).mean() + big.mean()


def test_low_mfu_flag_when_nvml_says_busy(agent: Any) -> None:
    from torchtop.monitor.diagnosis.diagnose import diagnose

    model = Elementwise().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    x = torch.randn(64, 1024, device="cuda")
    big = torch.randn(64 * 2**20, device="cuda")  # 256 MiB: each elementwise kernel takes a while
    feed = Feed(agent)
    try:
        end = time.monotonic() + 20
        while time.monotonic() < end:
            loss = model(x, big)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            feed.poll()
        d = diagnose(feed.state)
        t = d.verdict  # whatever the headline, the flag says NVML's busy is not useful work
        flags = {f.kind: f for f in d.flags}
    finally:
        feed.close()
    print(f"\n[low-mfu] verdict {t.kind}; flags {[(f.kind, f.evidence) for f in d.flags]}")
    assert "low-mfu" in flags, d
    assert flags["low-mfu"].upside is not None and flags["low-mfu"].upside.kind == "estimate"
