"""On-demand captures on CPU: a real loop, a real profiler trace, and every refusal."""

from __future__ import annotations

import gzip
import json
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, cast

import pytest
import torch

import torchtop.agent as ta
from tests.agent_util import CaptureProbe, client_for, endpoint_for
from torchtop.agent.capture.trace_summary import summarize

if TYPE_CHECKING:
    from torchtop.agent.hooks.probe import Probe


@pytest.fixture
def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TORCHTOP_DIR", str(tmp_path / "captures"))
    started = ta.start()
    assert started is not None
    return started


class Loop:
    """A training loop on this (the training) thread, stepping until told to stop."""

    def __init__(self) -> None:
        self.model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.x = torch.randn(32, 64)
        self.steps = 0

    def step(self) -> None:
        self.model(self.x).sum().backward()
        self.opt.step()
        self.opt.zero_grad()
        self.steps += 1


def _run_until(loop: Loop, cond, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        loop.step()
        time.sleep(0.002)


def test_profile_of_3_steps_has_exactly_3_profiler_steps_and_the_loop_never_stops(agent, tmp_path) -> None:
    loop = Loop()
    client = client_for(agent)
    box: dict = {}

    def ask() -> None:  # the monitor side, on its own thread, like the TUI's worker
        box["reply"] = client.request("capture-profile", {"steps": 3}, timeout=5)

    asker = threading.Thread(target=ask)
    asker.start()
    _run_until(loop, lambda: "reply" in box)
    asker.join()
    assert box["reply"].ok, box["reply"].error
    cap_id = box["reply"].capture.id
    before = loop.steps
    done: dict = {}

    def poll() -> None:
        while "cap" not in done:
            status = client.request("capture-status", timeout=5)
            found = next((c for c in status.captures if c.id == cap_id), None)
            if found is not None and found.state in ("done", "failed"):
                done["cap"] = found
            time.sleep(0.05)

    poller = threading.Thread(target=poll)
    poller.start()
    _run_until(loop, lambda: "cap" in done)
    poller.join()
    client.close()
    cap = done["cap"]
    assert cap.state == "done", cap.error
    assert loop.steps - before >= 4  # the loop kept going through start, 3 steps, stop and export
    path = Path(cap.path)
    assert path.parent == tmp_path / "captures" and path.name.endswith(".json.gz")
    with gzip.open(path, "rt") as fh:
        events = json.load(fh)["traceEvents"]
    spans = [e["name"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#")]
    assert len(spans) == 3, spans
    assert cap.summary["steps"] == 3 and cap.summary["gpu_idle"] is None
    assert (
        cap.summary["buckets"]["CPU Exec"] > 0.05
    )  # no GPU: host ops are the work (less on a loaded machine)
    assert any("addmm" in r["name"] or "linear" in r["name"] for r in cap.summary["top_cpu"])


@pytest.mark.parametrize(
    ("cmd", "args", "reason"),
    [
        ("capture-profile", {"steps": 0}, "steps must be in 1..100"),
        ("capture-profile", {"steps": 10**6}, "steps must be in 1..100"),
        ("capture-profile", {"steps": "3"}, "wrong type"),
        ("capture-profile", {"steps": True}, "not a boolean"),
        ("capture-profile", {"path": "../../etc/passwd"}, "unknown argument 'path'"),
        ("capture-profile", {"dir": "/tmp", "steps": 2}, "unknown argument 'dir'"),
        ("capture-memory", {"steps": 3}, "need CUDA"),
        ("capture-everything", {}, "unknown command"),
    ],
)
def test_invalid_requests_are_refused_with_a_reason(agent, cmd: str, args: dict, reason: str) -> None:
    client = client_for(agent)
    try:
        reply = client.request(cmd, args, timeout=5)
    finally:
        client.close()
    assert not reply.ok and reason in reply.error, reply.error
    assert agent.captures.current is None  # nothing was armed


def test_garbage_on_the_request_socket_is_refused(agent) -> None:
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint_for(agent).address)
    try:
        sock.send(b"\x93\x01\xa7capture\xc0")
        assert sock.poll(5000)
        from torchtop.contract import wire

        reply = wire.decode(sock.recv())
        assert isinstance(reply, wire.Reply)
        assert not reply.ok and "bad request" in reply.error
    finally:
        sock.close()
    assert agent.captures.current is None


def test_second_capture_while_one_runs_is_busy(agent) -> None:
    client = client_for(agent)
    try:
        first = client.request("capture-profile", {"steps": 5}, timeout=5)
        assert first.ok
        second = client.request("capture-profile", {"steps": 2}, timeout=5)
        assert not second.ok and second.error.startswith("busy: capture 1 (profile) is pending, 0/5 steps")
    finally:
        client.close()
    loop = Loop()
    _run_until(loop, lambda: agent.captures.current.state in ("done", "failed"))


def test_unusable_output_directory_falls_back_or_is_refused(tmp_path, monkeypatch, runtime_dir) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "captures").write_text("a file where the directory should be")
    monkeypatch.setenv("TORCHTOP_DIR", str(locked / "captures"))
    agent = ta.start()
    assert agent is not None
    captures = agent.captures
    client = client_for(agent)
    try:  # files go to the private fallback, and the reply says where and why
        reply = client.request("capture-profile", {"steps": 2}, timeout=5)
        assert reply.ok and reply.capture is not None, reply.error
        note = reply.capture.note
        assert str(runtime_dir / "captures") in note and str(locked / "captures") in note
        assert "TORCHTOP_DIR" in note
        _run_until(
            Loop(), lambda: captures.current is not None and captures.current.state in ("done", "failed")
        )
        current = captures.current
        assert current is not None and current.state == "done", current and current.error
        assert Path(current.path).parent == runtime_dir / "captures"
        # and when the fallback cannot be used either, the request is refused, saying why
        monkeypatch.setenv("TORCHTOP_RUNTIME_DIR", str(locked / "captures" / "rt"))
        reply = client.request("capture-profile", {"steps": 2}, timeout=5)
    finally:
        client.close()
    assert not reply.ok and "TORCHTOP_DIR" in reply.error and str(locked / "captures") in reply.error


@pytest.mark.slow  # a training subprocess and the CLI
def test_capture_cli_end_to_end(tmp_path) -> None:
    """`torchtop capture PID --steps 2 --json` against a training process."""
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(
        "import torch, time, torchtop.agent as ta\nta.start()\n"
        "m = torch.nn.Linear(64, 64); o = torch.optim.SGD(m.parameters(), 0.1)\n"
        "end = time.time() + 600\nwhile time.time() < end:\n    m(torch.randn(32, 64)).sum().backward(); o.step(); time.sleep(0.01)\n"
    )  # killed below: a length of its own could run out before a loaded machine's three captures
    env = dict(__import__("os").environ, TORCHTOP_DIR=str(tmp_path / "out"))
    child = subprocess.Popen([sys.executable, str(script)], env=env)
    try:
        from torchtop.contract import discovery

        deadline = time.monotonic() + 60
        while not discovery.list_agents():
            assert time.monotonic() < deadline
            time.sleep(0.2)

        def capture(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-m", "torchtop.monitor.commands.cli", "capture", str(child.pid), *args],
                capture_output=True,
                text=True,
                timeout=120,
            )

        out = capture("--steps", "2", "--json")
        assert out.returncode == 0, out.stderr
        cap = json.loads(out.stdout)
        assert cap["state"] == "done" and Path(cap["path"]).parent == tmp_path / "out"
        assert cap["summary"]["steps"] == 2
        text = capture("--steps", "2")
        assert text.returncode == 0, text.stderr
        assert f"  file: {tmp_path / 'out'}" in text.stdout  # this machine's path, as it is
        assert "scp" not in text.stdout  # nothing to fetch from a local run
        bad = capture("--memory")
        assert bad.returncode == 1 and "need CUDA" in bad.stderr
    finally:
        child.kill()
        child.wait()


@pytest.fixture
def controller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from torchtop.agent.capture.controller import CaptureController
    from torchtop.agent.cuda_use import CudaUse

    monkeypatch.setenv("TORCHTOP_DIR", str(tmp_path / "captures"))
    return CaptureController(CudaUse(torch), cast("Probe", CaptureProbe()))  # the part of a Probe it uses


def test_the_capture_record_has_one_owner_the_agent_thread(controller) -> None:
    """The training and writer threads post news; only poll() (the agent thread) publishes a new,
    frozen CaptureInfo. A published record never changes under a reader."""
    import msgspec

    from torchtop.contract.wire import CaptureState

    probe, model = controller.probe, torch.nn.Linear(8, 8)
    pending = controller.request("capture-profile", {"steps": 2})
    assert pending.state == CaptureState.PENDING and probe.hooks.names() == ["capture"]
    probe.on_step()  # the training thread's boundary: the profiler starts
    assert controller.current is pending  # nothing published off the agent thread
    controller.poll()
    running = controller.current
    assert running.state == CaptureState.RUNNING and pending.state == CaptureState.PENDING
    with pytest.raises(AttributeError):
        running.state = CaptureState.DONE  # type: ignore[misc]
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
        probe.on_step()
    assert probe.on_step is None  # disarmed after exactly 2 steps
    deadline = time.monotonic() + 60
    while controller.current.state != CaptureState.DONE:
        assert time.monotonic() < deadline and controller.current.state != CaptureState.FAILED, (
            controller.current
        )
        time.sleep(0.02)
        controller.poll()
    done = controller.current
    assert done.steps_done == 2 and done.path and running.state == CaptureState.RUNNING
    assert controller.status() == [done] and msgspec.msgpack.encode(done)


def test_a_start_timeout_is_final_even_if_a_boundary_comes_late(controller, monkeypatch) -> None:
    from torchtop.agent.capture import controller as module
    from torchtop.contract.wire import CaptureState

    monkeypatch.setattr(module, "START_TIMEOUT_S", 0.0)
    late = controller.on_boundary  # what a training thread already inside the boundary holds
    controller.request("capture-profile", {"steps": 2})
    time.sleep(0.01)
    controller.poll()
    assert controller.current.state == CaptureState.FAILED and "no step boundary" in controller.current.error
    assert controller.probe.on_step is None
    late()  # no profiler starts after the capture failed
    assert controller._run is not None and not controller._run.started
    controller.poll()
    assert controller.current.state == CaptureState.FAILED


def test_a_failing_profiler_step_fails_the_capture_and_stops_the_profiler(controller) -> None:
    from torchtop.contract.wire import CaptureState

    probe = controller.probe
    controller.request("capture-profile", {"steps": 3})
    probe.on_step()  # started
    assert torch.autograd._profiler_enabled()  # pyright: ignore[reportPrivateImportUsage]  # torch re-exports it

    def broken() -> None:
        raise RuntimeError("profiler step broke")

    controller._run.prof.step = broken
    probe.on_step()  # never raises into the training loop
    profiling = torch.autograd._profiler_enabled()  # pyright: ignore[reportPrivateImportUsage]  # torch re-exports it
    assert probe.on_step is None and not profiling
    controller.poll()
    assert (
        controller.current.state == CaptureState.FAILED and "profiler step broke" in controller.current.error
    )


def test_the_agent_leaves_the_warning_filters_as_it_found_them(tmp_path, monkeypatch) -> None:
    """Its own filters (torch.compile's global-hook warning, the profiler export's) go with it:
    none stays in the user's process after stop()."""
    import warnings

    from torchtop.contract.wire import CaptureState

    monkeypatch.setenv("TORCHTOP_DIR", str(tmp_path / "captures"))
    before = list(warnings.filters)
    agent = ta.start()
    assert agent is not None
    loop = Loop()
    client = client_for(agent)
    box: dict = {}
    asker = threading.Thread(
        target=lambda: box.update(r=client.request("capture-profile", {"steps": 2}, timeout=5))
    )
    asker.start()
    _run_until(loop, lambda: "r" in box)
    asker.join()
    client.close()
    assert box["r"].ok, box["r"].error
    captures = agent.captures
    ended = (CaptureState.DONE, CaptureState.FAILED)
    _run_until(loop, lambda: captures.current is not None and captures.current.state in ended)
    current = captures.current
    assert current is not None and current.state == CaptureState.DONE, current and current.error
    ta.stop()
    assert warnings.filters == before


def test_summarize_buckets_by_priority() -> None:
    events = [
        {"ph": "X", "name": "ProfilerStep#0", "cat": "user_annotation", "ts": 0, "dur": 100},
        {"ph": "X", "name": "ProfilerStep#0", "cat": "gpu_user_annotation", "ts": 0, "dur": 100},
        {"ph": "X", "name": "aten::mm", "cat": "cpu_op", "ts": 0, "dur": 50},
        {"ph": "X", "name": "cudaLaunchKernel", "cat": "cuda_runtime", "ts": 10, "dur": 5},
        {"ph": "X", "name": "gemm", "cat": "kernel", "ts": 20, "dur": 60},
        {"ph": "X", "name": "ncclAllReduce", "cat": "kernel", "ts": 70, "dur": 20},
        {"ph": "X", "name": "Memcpy HtoD", "cat": "gpu_memcpy", "ts": 92, "dur": 4},
        {
            "ph": "X",
            "name": "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__",
            "cat": "user_annotation",
            "ts": 85,
            "dur": 10,
        },
    ]
    s = summarize(events)
    assert s["steps"] == 1 and s["step_ms"] == pytest.approx(0.1)
    b = s["buckets"]
    assert b["Kernel"] == pytest.approx(0.60)  # 20-80 (overlapping NCCL counts as Kernel first)
    assert b["Communication"] == pytest.approx(0.10)  # 80-90
    assert b["Memcpy"] == pytest.approx(0.04)
    assert b["Runtime"] == pytest.approx(0.05)
    assert b["DataLoader"] == pytest.approx(0.02)  # 90-92 and 96-... minus memcpy: 90-92 only...
    assert sum(b.values()) == pytest.approx(1.0)
    assert s["gpu_idle"] == pytest.approx(1 - 0.74)


def test_summarize_follows_the_gpu_behind_the_host() -> None:
    """The host finished launching step 0 at 10 us; its kernels ran 20-50 us, inside the GPU-side span."""
    events = [
        {"ph": "X", "name": "ProfilerStep#0", "cat": "user_annotation", "ts": 0, "dur": 10},
        {"ph": "X", "name": "ProfilerStep#0", "cat": "gpu_user_annotation", "ts": 5, "dur": 55},
        {"ph": "X", "name": "cudaLaunchKernel", "cat": "cuda_runtime", "ts": 2, "dur": 3},
        {"ph": "X", "name": "gemm", "cat": "kernel", "ts": 20, "dur": 30},
    ]
    s = summarize(events)
    assert s["steps"] == 1 and s["step_ms"] == pytest.approx(0.06)
    assert s["buckets"]["Kernel"] == pytest.approx(0.5) and s["gpu_idle"] == pytest.approx(0.5)


def test_summarize_leaves_out_the_profilers_own_stop_sync() -> None:
    """torch.profiler's stop drains the GPU inside the last step's span: that wait is not the step."""
    events = [
        {"ph": "X", "name": "ProfilerStep#0", "cat": "user_annotation", "ts": 0, "dur": 10},
        {"ph": "X", "name": "ProfilerStep#1", "cat": "user_annotation", "ts": 10, "dur": 290},
        {"ph": "X", "name": "gemm", "cat": "kernel", "ts": 5, "dur": 40},
        {"ph": "X", "name": "gemm", "cat": "kernel", "ts": 45, "dur": 40},
        {"ph": "X", "name": "ProfilerStep#1", "cat": "gpu_user_annotation", "ts": 45, "dur": 40},
        {"ph": "X", "name": "cudaDeviceSynchronize", "cat": "cuda_runtime", "ts": 20, "dur": 280},
    ]
    s = summarize(events)
    assert s["buckets"]["Runtime"] == 0.0
    assert s["step_ms"] == pytest.approx(0.085 / 2)  # 0-85 us: the kernels, not the 300 us wait
    assert s["buckets"]["Kernel"] == pytest.approx(80 / 85, abs=1e-4)  # shares are rounded to 5 places


def test_summarize_does_not_call_a_backlog_before_the_capture_idle() -> None:
    """The GPU still ran work queued before the profiler started (not in the trace): the first
    step's kernel, launched at 2 us, ran at 500 us. Until then the GPU was busy, not idle."""
    events = [
        {"ph": "X", "name": "ProfilerStep#0", "cat": "user_annotation", "ts": 0, "dur": 10},
        {"ph": "X", "name": "ProfilerStep#1", "cat": "user_annotation", "ts": 10, "dur": 10},
        {
            "ph": "X",
            "name": "cudaLaunchKernel",
            "cat": "cuda_runtime",
            "ts": 2,
            "dur": 3,
            "args": {"correlation": 7},
        },
        {
            "ph": "X",
            "name": "cudaLaunchKernel",
            "cat": "cuda_runtime",
            "ts": 12,
            "dur": 3,
            "args": {"correlation": 8},
        },
        {"ph": "X", "name": "gemm", "cat": "kernel", "ts": 500, "dur": 30, "args": {"correlation": 7}},
        {"ph": "X", "name": "gemm", "cat": "kernel", "ts": 530, "dur": 30, "args": {"correlation": 8}},
        {"ph": "X", "name": "ProfilerStep#0", "cat": "gpu_user_annotation", "ts": 500, "dur": 30},
        {"ph": "X", "name": "ProfilerStep#1", "cat": "gpu_user_annotation", "ts": 530, "dur": 30},
    ]
    s = summarize(events)
    assert s["step_ms"] == pytest.approx(0.03)
    assert s["buckets"]["Kernel"] == pytest.approx(1.0) and s["gpu_idle"] == pytest.approx(0.0)
    # a kernel that ran right after its launch: the window is the host's, idle time stays idle
    events[4] = {**events[4], "ts": 40}
    events[6] = {**events[6], "ts": 40}
    s = summarize(events)
    assert s["gpu_idle"] > 0.5


def test_a_capture_waits_for_its_step(controller) -> None:
    """`at_step` (the job view asks every rank for the same steps): the profiler starts at the
    boundary where the run's step count reaches it, and the capture says where it started."""
    from torchtop.contract.wire import CaptureState

    probe = controller.probe
    controller.request("capture-profile", {"steps": 1, "at_step": 12})
    for probe.steps in (10, 11):
        probe.on_step()
        controller.poll()
        assert controller.current.state == CaptureState.PENDING
    probe.steps = 12
    probe.on_step()
    controller.poll()
    assert controller.current.state == CaptureState.RUNNING and controller.current.start_step == 12
    probe.on_step()  # the one step: stop and write
    assert probe.on_step is None


def test_at_step_must_be_a_step_number(controller) -> None:
    from torchtop.agent.capture.arguments import CaptureError

    with pytest.raises(CaptureError, match="at_step must be a step number"):
        controller.request("capture-profile", {"at_step": -1})
