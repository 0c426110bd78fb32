"""A memory capture's growing allocation sites (issue 38, item 3): live bytes by site at its
midpoint against its end, over synthetic `torch.cuda.memory._snapshot()` dicts; the controller
with a fake torch (the snapshots taken off the training thread); the text; the leak flag's hint."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

import pytest

from tests.agent_util import CaptureProbe
from torchtop.agent.capture.memory_growth import (
    FLOOR,
    LISTED,
    SITE_CHARS,
    Midpoint,
    growing_sites,
    live_by_site,
    record_history,
)
from torchtop.contract.capture import CaptureInfo, CaptureKind, CaptureState
from torchtop.monitor.diagnosis.facts import Facts, Growth
from torchtop.monitor.diagnosis.flags import LEAK_SITES, flag_memory_leak
from torchtop.monitor.model.captures import capture_lines, describe

if TYPE_CHECKING:
    from torchtop.agent.hooks.probe import Probe

MIB, KIB = 2**20, 2**10
TRAIN = "/home/u/proj/train.py"


def _frames(line: int, filename: str = TRAIN, name: str = "step") -> list[dict[str, Any]]:
    """A Python-only stack: torch's own frame innermost, then the user's."""
    return [
        {
            "filename": "/venv/lib/python3.11/site-packages/torch/nn/modules/linear.py",
            "line": 125,
            "name": "forward",
        },
        {"filename": filename, "line": line, "name": name},
    ]


def _snapshot(
    blocks: list[tuple[int, int, int]], trace: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """One segment of (address, line, bytes) live blocks, a free block, and the allocator trace."""
    live = [
        {"address": a, "size": b, "requested_size": b, "state": "active_allocated", "frames": _frames(line)}
        for a, line, b in blocks
    ]
    free = {"address": 1, "size": 64 * MIB, "requested_size": 0, "state": "inactive", "frames": []}
    return {
        "segments": [{"device": 0, "address": 0, "blocks": [*live, free]}],
        "device_traces": [trace or []],
    }


def _site(line: int) -> str:
    return f"{TRAIN}:{line} step"


# -- the diff -------------------------------------------------------------------------------------
def test_a_growing_site_ranks_first_a_steady_or_shrinking_one_is_not_listed() -> None:
    first = live_by_site(_snapshot([(10, 20, 400 * MIB), (20, 41, 10 * MIB), (30, 50, 64 * MIB)]))
    last = live_by_site(
        _snapshot([(10, 20, 400 * MIB), (20, 41, 10 * MIB), (21, 41, 24 * MIB), (40, 60, 3 * MIB)])
    )
    assert first == {_site(20): 400 * MIB, _site(41): 10 * MIB, _site(50): 64 * MIB}  # free blocks left out
    got = growing_sites(first, last, steps=200)
    assert [(g["site"], g["bytes"]) for g in got] == [(_site(41), 24 * MIB), (_site(60), 3 * MIB)]
    assert got[0]["per_step"] == round(24 * MIB / 200)  # steady (20) and shrinking (50) left out


def test_a_steps_transient_tensors_are_cut_back_to_the_boundary() -> None:
    """The last snapshot is taken while the next step runs: its activations (allocated after the
    boundary) are left out, and a tensor live at the boundary but freed since is put back."""
    cut = 1_000.0  # the boundary, time.time() seconds; the trace says epoch microseconds
    us = cut * 1e6
    trace = [
        {"action": "alloc", "addr": 20, "size": 10 * MIB, "time_us": us - 50, "frames": _frames(41)},
        {"action": "alloc", "addr": 70, "size": 6 * MIB, "time_us": us - 40, "frames": _frames(77)},
        {"action": "alloc", "addr": 90, "size": 2 * MIB, "time_us": us - 30, "frames": _frames(88)},
        {"action": "free_requested", "addr": 90, "size": 2 * MIB, "time_us": us - 20, "frames": []},
        {"action": "alloc", "addr": 50, "size": 900 * MIB, "time_us": us + 10, "frames": _frames(99)},
        {"action": "free_requested", "addr": 70, "size": 6 * MIB, "time_us": us + 20, "frames": []},
        {"action": "alloc", "addr": 60, "size": 5 * MIB, "time_us": us + 30, "frames": _frames(98)},
        {"action": "free_requested", "addr": 60, "size": 5 * MIB, "time_us": us + 40, "frames": []},
    ]
    snap = _snapshot([(20, 41, 10 * MIB), (50, 99, 900 * MIB)], trace)
    assert live_by_site(snap) == {_site(41): 10 * MIB, _site(99): 900 * MIB}  # uncut: as taken
    assert live_by_site(snap, cut) == {_site(41): 10 * MIB, _site(77): 6 * MIB}  # at the boundary
    before = live_by_site(_snapshot([(20, 41, 4 * MIB)]))
    grown = growing_sites(before, live_by_site(snap, cut), steps=3)
    assert [g["site"] for g in grown] == [_site(41), _site(77)]  # never the 900 MiB of activations


def test_the_list_is_bounded_and_small_growth_left_out() -> None:
    first = {f"{TRAIN}:{i} step": 0 for i in range(40)}
    last = {f"{TRAIN}:{i} step": (i + 1) * MIB for i in range(40)}
    last["x" * 5000] = 100 * MIB
    last["small"] = FLOOR - 1
    got = growing_sites(first, last, steps=1000)
    assert len(got) == LISTED and got[0]["site"] == "x" * SITE_CHARS
    assert [g["bytes"] for g in got[1:]] == [(40 - i) * MIB for i in range(LISTED - 1)]  # most first
    assert all(g["site"] != "small" for g in growing_sites(first, last, steps=1000, n=100))
    assert growing_sites({}, {}, steps=5) == [] and growing_sites({"a": 9 * MIB}, {}, steps=5) == []


def test_a_malformed_snapshot_reads_as_what_it_can() -> None:
    snap: dict[str, Any] = {
        "segments": [{"blocks": [{"state": "active_allocated", "size": "big"}, {}]}, {"blocks": None}],
        "device_traces": [[{"action": "alloc", "addr": "x", "time_us": 1}, {"action": "alloc"}], None],
    }
    assert sum(live_by_site(snap, 0.0).values()) == 0 and live_by_site({}) == {}


class _History:
    """torch.cuda.memory's history switch, as a torch with or without `stacks` has it."""

    def __init__(self, stacks: bool) -> None:
        self.calls: list[dict[str, Any]] = []
        self.stacks = stacks

    def _record_memory_history(self, enabled: Any = "all", **kwargs: Any) -> None:
        if "stacks" in kwargs and not self.stacks:
            raise TypeError("_record_memory_history() got an unexpected keyword argument 'stacks'")
        self.calls.append({"enabled": enabled, **kwargs})


def test_history_is_recorded_with_python_stacks_where_the_torch_takes_them() -> None:
    new, old = _History(stacks=True), _History(stacks=False)
    record_history(new)
    record_history(old)
    assert new.calls == [{"enabled": "all", "max_entries": 200_000, "stacks": "python"}]
    assert old.calls == [{"enabled": "all", "max_entries": 200_000}]  # silently without


def test_a_failed_first_snapshot_says_why() -> None:
    def broken() -> dict[str, Any]:
        raise RuntimeError("allocator said no")

    first = Midpoint(broken, step=2, at=0.0)
    first.wait()
    assert first.summary(_snapshot([]), 5, 0.0) == {
        "growth_note": "the first snapshot failed: RuntimeError: allocator said no"
    }
    same = Midpoint(lambda: _snapshot([]), step=5, at=0.0)
    same.wait()
    assert "growth_note" in same.summary(_snapshot([]), 5, 0.0)  # no step between them


# -- the controller, with a fake torch ------------------------------------------------------------
class _Memory(_History):
    """torch.cuda.memory over a fake allocator: the test's loop allocates, `_snapshot` reads it
    from whichever thread calls it (each call's thread kept)."""

    def __init__(self) -> None:
        super().__init__(stacks=True)
        self.blocks: list[tuple[int, int, int]] = [(1, 20, 300 * MIB)]  # the parameters: steady
        self.threads: list[threading.Thread] = []
        self.fail = False

    def _snapshot(self) -> dict[str, Any]:
        self.threads.append(threading.current_thread())
        if self.fail:
            raise RuntimeError("allocator said no")
        return _snapshot(list(self.blocks))


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    from torchtop.agent.capture.controller import CaptureController
    from torchtop.agent.cuda_use import CudaUse

    monkeypatch.setenv("TORCHTOP_DIR", str(tmp_path / "captures"))
    memory = _Memory()
    cuda = SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True, memory=memory)
    torch = cast("Any", SimpleNamespace(cuda=cuda))
    return CaptureController(CudaUse(torch), cast("Probe", CaptureProbe())), memory


def _finish(controller: Any) -> CaptureInfo:
    deadline = time.monotonic() + 30
    while controller.current.state not in (CaptureState.DONE, CaptureState.FAILED):
        assert time.monotonic() < deadline, controller.current
        time.sleep(0.01)
        controller.poll()
    return controller.current


def test_the_midpoint_snapshot_is_taken_off_the_training_thread(fake: Any) -> None:
    controller, memory = fake
    probe = controller.probe
    controller.request("capture-memory", {"steps": 6})
    probe.on_step()  # the boundary it starts at: history on, Python stacks only
    assert memory.calls == [{"enabled": "all", "max_entries": 200_000, "stacks": "python"}]
    for step in range(1, 7):
        memory.blocks.append((100 + step, 41, 2 * MIB))  # train.py:41 keeps 2 MiB a step
        memory.blocks.append((200 + step, 60, 64 * KIB))  # a small leak: under the floor
        probe.on_step()
        if step == 3:  # its midpoint: the first snapshot is the spawned thread's
            assert controller._run.first is not None
            controller._run.first.wait()
            assert len(memory.threads) == 1
    done = _finish(controller)
    assert done.state == CaptureState.DONE and probe.on_step is None
    main = threading.current_thread()
    assert len(memory.threads) == 2 and all(t is not main for t in memory.threads)
    assert memory.calls[-1] == {"enabled": None}  # history off
    s = done.summary
    assert s["growth_steps"] == 3 and s["top_sites"] == []
    assert s["growing_sites"] == [{"site": _site(41), "bytes": 6 * MIB, "per_step": 2 * MIB}]
    assert "train.py:41 step +6.00 MiB (+2.00 MiB a step)" in describe(done)


def test_a_failing_midpoint_leaves_the_capture_and_history_off(fake: Any) -> None:
    controller, memory = fake
    probe = controller.probe
    controller.request("capture-memory", {"steps": 2})
    probe.on_step()
    memory.fail = True
    probe.on_step()  # the midpoint: its snapshot fails on its thread
    controller._run.first.wait()
    memory.fail = False
    probe.on_step()
    done = _finish(controller)
    assert done.state == CaptureState.DONE and memory.calls[-1] == {"enabled": None}
    assert done.summary["growth_note"] == "the first snapshot failed: RuntimeError: allocator said no"
    assert "growing_sites" not in done.summary
    assert "growth not measured: the first snapshot failed" in describe(done)


def test_a_one_step_capture_has_no_growth(fake: Any) -> None:
    controller, memory = fake
    controller.request("capture-memory", {"steps": 1})
    controller.probe.on_step()
    controller.probe.on_step()
    done = _finish(controller)
    assert done.state == CaptureState.DONE and len(memory.threads) == 1
    assert not {"growing_sites", "growth_note", "growth_steps"} & set(done.summary)


def test_a_timed_capture_takes_its_first_snapshot_halfway(fake: Any) -> None:
    controller, memory = fake
    probe = controller.probe
    controller.request("capture-memory", {"seconds": 0.2})
    probe.on_step()
    controller.poll()  # running
    probe.on_step()
    memory.blocks.append((300, 41, 3 * MIB))
    deadline = time.monotonic() + 30
    while controller._run.first is None:  # the agent thread's poll, past half the seconds
        assert time.monotonic() < deadline
        time.sleep(0.01)
        controller.poll()
    controller._run.first.wait()
    for k in range(4):
        memory.blocks.append((400 + k, 41, 3 * MIB))
        probe.on_step()
    done = _finish(controller)
    assert done.state == CaptureState.DONE and threading.current_thread() not in memory.threads
    assert done.summary["growth_steps"] == 4
    assert done.summary["growing_sites"][0]["bytes"] == 12 * MIB


# -- the text -------------------------------------------------------------------------------------
def _done(summary: dict[str, Any]) -> CaptureInfo:
    return CaptureInfo(
        id=3, kind=CaptureKind.MEMORY, state=CaptureState.DONE, path="/tmp/x.pickle", summary=summary
    )


def test_the_growing_sites_in_the_captures_answer() -> None:
    rows = [{"site": _site(41), "bytes": 12 * MIB, "per_step": round(12 * MIB / 200)}]
    lines = capture_lines(_done({"growing_sites": rows, "growth_steps": 200}), None)
    at = lines.index("  grew over 200 steps:")
    assert lines[at + 1] == "    train.py:41 step +12.0 MiB (+61.4 KiB a step)"
    none = describe(_done({"growing_sites": [], "growth_steps": 5}))
    assert none.endswith("no allocation site grew by 1 MiB or more over 5 steps")
    assert "grew" not in describe(_done({"top_sites": []}))  # a capture without growth: nothing said


def test_malformed_growth_from_an_agent_is_skipped() -> None:
    bad: list[Any] = [
        "x",
        {"site": 3, "bytes": MIB, "per_step": 1},
        {"site": "a.py:1 f", "bytes": float("nan"), "per_step": 1},
        {"site": "a.py:2 f", "bytes": -MIB, "per_step": 1},
        {"site": "a.py:3 f", "bytes": True, "per_step": 1},
        {"site": "a.py:4 f", "bytes": 2 * MIB},
        {"site": "/x/b.py:9 g" + "y" * 1000, "bytes": 2 * MIB, "per_step": 1024},
    ]
    text = describe(_done({"growing_sites": bad, "growth_steps": 2}))
    assert text.count("\n    ") == 1 and "b.py:9 g" in text and len(text.splitlines()[-1]) < 340
    for steps in (0, -1, "3", True, None):
        assert "grew" not in describe(_done({"growing_sites": bad, "growth_steps": steps}))
    assert "grew" not in describe(_done({"growing_sites": "lots", "growth_steps": 3}))


def test_the_leak_flag_on_cuda_ends_with_where_to_find_its_sites() -> None:
    leak = Growth(400 * MIB, 460 * MIB, 30.0, 0.9, 0.2 * MIB, 30, 0.2 * MIB, 300)
    f = Facts(1, 1.0, {}, {}, growth=leak)
    f.growth_what = "allocated CUDA memory"
    cuda = flag_memory_leak(f)
    assert cuda is not None and cuda.evidence[-1] == LEAK_SITES and "--memory" in LEAK_SITES
    f.growth_what = "process RSS"  # no CUDA snapshot on CPU: not offered
    cpu = flag_memory_leak(f)
    assert cpu is not None and all("memory capture" not in e for e in (*cpu.evidence, *cpu.advice))
