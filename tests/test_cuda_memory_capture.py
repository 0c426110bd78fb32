"""CUDA memory figures and on-demand captures on a real GPU (skipped without one).

- a known fragmentation pattern (many sizes, every other one freed): the agent's inactive-split
  bytes, largest free block and external fragmentation equal what the test computes itself from
  `memory_snapshot()` and `memory_stats()`;
- a profiler capture of a matmul-heavy loop: kernels in the trace, exactly N ProfilerStep spans,
  the bucket breakdown mostly Kernel;
- a memory snapshot capture that opens with pickle and has segments.
"""

from __future__ import annotations

import gzip
import json
import pickle
import stat
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]

import torchtop.agent  # noqa: E402
from torchtop.agent.telemetry.cuda_memory import fragmentation  # noqa: E402

MIB = 2**20


@pytest.fixture
def agent(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Any:
    monkeypatch.setenv("TORCHTOP_QUIET", "1")
    monkeypatch.setenv("TORCHTOP_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("TORCHTOP_DIR", str(tmp_path / "captures"))
    torch.cuda.init()
    started = torchtop.agent.start()
    assert started is not None
    try:
        yield started
    finally:
        torchtop.agent.stop()


def _client(agent: Any) -> Any:
    from tests.agent_util import client_for

    return client_for(agent)


def test_fragmentation_matches_memory_snapshot(agent: Any) -> None:
    torch.cuda.empty_cache()
    sizes = [(1 + (k * 7) % 9) * MIB + k * 4096 for k in range(120)]  # 1..9 MiB, all different
    blocks = [torch.empty(s, dtype=torch.uint8, device="cuda") for s in sizes]
    del blocks[::2]  # free every other one: holes between live blocks inside 20 MiB segments
    torch.cuda.synchronize()  # the test's own sync, before it reads; the agent never syncs
    dev = torch.cuda.current_device()
    expected = fragmentation(torch.cuda.memory_snapshot(), dev)
    stats = torch.cuda.memory_stats(dev)
    assert expected.total_free > 0 and expected.external > 0.5  # the pattern is fragmented

    deadline = time.monotonic() + 40
    got = None
    while time.monotonic() < deadline:
        tel = agent.telemetry.latest()
        frag = next((f for f in tel.frag if f.device == dev), None)
        mem = next((m for m in tel.memory if m.device == dev), None)
        if frag is not None and mem is not None and frag.total_free == expected.total_free:
            got = frag, mem
            break
        time.sleep(0.1)
    assert got is not None, f"no fragmentation sample matching {expected} within 40 s"
    frag, mem = got
    print(f"\nfragmentation: agent {frag}\n               test  {expected}")
    assert frag.largest_free == expected.largest_free
    assert frag.segments == expected.segments
    assert frag.external == pytest.approx(expected.external)
    assert mem.inactive_split == stats["inactive_split_bytes.all.current"]
    assert mem.allocated == stats["allocated_bytes.all.current"]
    assert mem.reserved == stats["reserved_bytes.all.current"]
    assert frag.cost_ms > 0 and frag.interval_s >= 1.0
    del blocks


def _matmul_loop() -> tuple[Any, Any]:
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, bias=False) for _ in range(4)]).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(4096, 4096, device="cuda")

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, step


def _capture(agent: Any, cmd: str, args: dict[str, Any], step: Any, timeout: float = 120) -> Any:
    client = _client(agent)
    try:
        reply = client.request(cmd, args, timeout=5.0)
        assert reply.ok, reply.error
        want = reply.capture.id
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for _ in range(3):
                step()  # the training loop never stops for the capture
            status = client.request("capture-status", timeout=5.0)
            found = next((c for c in status.captures if c.id == want), None)
            if found is not None and found.state in ("done", "failed"):
                assert found.state == "done", found.error
                return found
        raise AssertionError(f"capture {want} did not finish")
    finally:
        client.close()


def test_profile_capture_of_matmul_loop_is_mostly_kernel(agent: Any) -> None:
    _, step = _matmul_loop()
    for _ in range(5):
        step()
    t = time.perf_counter()
    cap = _capture(agent, "capture-profile", {"steps": 3}, step)
    print(f"\nprofile capture: {cap.path} in {time.perf_counter() - t:.1f} s; summary {cap.summary}")
    with gzip.open(cap.path, "rt") as fh:
        events = json.load(fh)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    assert kernels, "no CUDA kernels in the trace"
    steps = {
        e["name"]
        for e in events
        if str(e.get("name", "")).startswith("ProfilerStep#") and e.get("cat") == "user_annotation"
    }
    assert len(steps) == 3, steps
    assert cap.summary["steps"] == 3
    assert cap.summary["buckets"]["Kernel"] >= 0.5, cap.summary["buckets"]
    assert cap.summary["gpu_idle"] is not None and cap.summary["gpu_idle"] < 0.5
    assert cap.summary["top_device"], "no ops by device time"


def test_memory_snapshot_capture_opens_with_pickle(agent: Any, tmp_path: Any) -> None:
    _, step = _matmul_loop()
    step()
    cap = _capture(agent, "capture-memory", {"steps": 3}, step)
    path = Path(cap.path)
    assert path.parent == tmp_path / "captures" and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert cap.note == ""  # the directory asked for was used
    with open(cap.path, "rb") as fh:
        snapshot = pickle.load(fh)
    print(f"\nmemory capture: {cap.path}; summary {cap.summary}")
    assert snapshot["segments"], "no segments in the snapshot"
    assert cap.summary["segments"] == len(snapshot["segments"])
    assert cap.summary["top_sites"], "no allocation sites"
    assert any("test_cuda_memory_capture.py" in s["site"] for s in cap.summary["top_sites"])


def test_memory_capture_names_the_site_that_grows(agent: Any) -> None:
    """Issue 38: a loop that keeps 2 MiB a step at one line and makes and frees 64 MiB blocks of
    activations: the capture's two snapshots (its midpoint and its end, each cut back to its step
    boundary) name the keeping line first at 2 MiB a step, and never the activations."""
    model = torch.nn.Linear(4096, 4096, bias=False).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(4096, 4096, device="cuda")
    kept: list[Any] = []

    def step() -> None:
        model(model(x)).square().mean().backward()  # activations, freed within the step
        kept.append(torch.ones(2 * MIB, dtype=torch.uint8, device="cuda"))  # the leak
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    cap = _capture(agent, "capture-memory", {"steps": 20}, step)
    s = cap.summary
    print(f"\ngrowth: {s.get('growth_steps')} steps {s.get('growing_sites')} {s.get('growth_note', '')}")
    assert s["growth_steps"] == 10, s
    top = s["growing_sites"][0]
    assert "test_cuda_memory_capture.py" in top["site"] and top["site"].endswith(" step"), top
    assert 0.9 <= top["per_step"] / (2 * MIB) <= 1.1, top
    assert all(g["bytes"] < 64 * MIB for g in s["growing_sites"]), s["growing_sites"]
