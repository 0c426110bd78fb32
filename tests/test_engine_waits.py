"""Collective waits that happen off the training thread, and FSDP2's all-gather wait alone.

On CUDA the autograd engine runs a backward's nodes on a device thread of its own: FSDP2's
backward all-gathers (resharded parameters) wait there, not on the training thread. A wait hook
logs from that thread while a timed backward of a distributed run is in progress, and from no
other thread. FSDP2's copy-out is timed as COMM only for the stream's wait in it; its copies stay
in the phase around it. Found on two H200s: the waiting rank's backward all-gather waits read as
backward, and its exposed wait read 5.9 ms a step where torch.profiler's kernel timeline read
17.7 ms (docs/benchmarks.md). CPU has no device thread: the engine and the stream are stubs here.
"""

from __future__ import annotations

import threading
from types import ModuleType, SimpleNamespace
from typing import Any, cast

from torchtop.agent.hooks.collectives import timed_backward
from torchtop.agent.hooks.probe import Probe
from torchtop.agent.hooks.waits import timed_wait
from torchtop.contract.logcodes import BACKWARD, COMM, COMM_GROUP, EXIT


def _codes(probe: Probe) -> list[int]:
    """The log's plain codes (a COMM_GROUP entry, a tuple, left out)."""
    return [int(x) for x in probe.log[1::2] if not isinstance(x, tuple)]


def _engine_stub(probe: Probe, task: int = 0) -> Any:
    """torch as the hooks see it: `_current_graph_task_id` is `task` on any thread but the
    training thread's (-1 there: outside a backward)."""

    def graph_task() -> int:
        return -1 if threading.get_ident() == probe.tid else task

    return SimpleNamespace(_C=SimpleNamespace(_current_graph_task_id=graph_task))


def _on_thread(fn: Any, *args: Any) -> None:
    t = threading.Thread(target=fn, args=args)
    t.start()
    t.join()


def test_a_wait_on_the_engine_thread_during_a_timed_backward_is_comm() -> None:
    probe = Probe()
    wait = timed_wait(probe, lambda work: None, _engine_stub(probe), lambda: False)
    _on_thread(wait, object())  # no backward running: another thread's wait is not ours
    assert _codes(probe) == []
    probe.engine = True
    _on_thread(wait, object())
    assert _codes(probe) == [COMM, EXIT | COMM]


def test_an_engine_flag_alone_does_not_let_other_threads_log() -> None:
    """A thread outside the autograd engine (a loader's, the user's) during a timed backward."""
    probe = Probe()
    probe.engine = True
    wait = timed_wait(probe, lambda work: None, _engine_stub(probe, task=-1), lambda: False)
    _on_thread(wait, object())
    assert _codes(probe) == []


def test_a_timed_distributed_backward_sets_the_engine_flag_only_while_it_runs() -> None:
    probe = Probe()
    probe.comm = True
    seen: list[bool] = []

    def backward(tensors: Any) -> None:
        seen.append(probe.engine)

    timed = timed_backward(probe, backward, lambda tensors: None)
    timed(object())
    assert seen == [True] and probe.engine is False
    assert _codes(probe) == [BACKWARD, EXIT | BACKWARD]
    probe.comm = False  # a run without a process group: no waits to log, the flag stays down
    timed(object())
    assert seen == [True, False]


def test_an_untimed_step_logs_no_engine_wait() -> None:
    probe = Probe()
    probe.engine = True
    probe.untimed = 2
    wait = timed_wait(probe, lambda work: None, _engine_stub(probe), lambda: False)
    _on_thread(wait, object())
    assert _codes(probe) == []


class _Stream:
    def __init__(self, probe: Probe, calls: list[tuple[str, int]]) -> None:
        self.probe, self.calls = probe, calls

    def wait_event(self, event: Any) -> None:
        self.calls.append((f"wait {event}", len(self.probe.log)))


def _copy_out_case(event: Any) -> tuple[Probe, list[tuple[str, int]], Any]:
    probe = Probe()
    calls: list[tuple[str, int]] = []
    stream = _Stream(probe, calls)
    stub = SimpleNamespace(
        _C=SimpleNamespace(_current_graph_task_id=lambda: -1),
        fake=SimpleNamespace(current_stream=lambda: stream),
    )

    def copy_out(all_gather_result: Any, fsdp_params: Any, group: Any) -> None:
        calls.append(("copy-out", len(probe.log)))

    wrapped = timed_wait(probe, copy_out, cast("ModuleType", stub), lambda: False, "copy_out")
    result = SimpleNamespace(
        all_gather_event=event, all_gather_output=SimpleNamespace(device=SimpleNamespace(type="fake"))
    )
    wrapped(result, [], None)
    return probe, calls, result


def test_fsdp2_copy_out_times_the_streams_wait_alone() -> None:
    probe, calls, _ = _copy_out_case("ag-event")
    assert _codes(probe) == [COMM, EXIT | COMM]
    # the wait is made between the two entries (and the group's); the copies after the last
    assert calls == [("wait ag-event", 4), ("copy-out", 6)]


def test_fsdp2_copy_out_without_an_event_passes_through() -> None:
    """An async all-gather (its wait is Work.wait's, timed there) or a CPU one."""
    probe, calls, _ = _copy_out_case(None)
    assert _codes(probe) == []
    assert calls == [("copy-out", 0)]


def test_fsdp2_copy_out_names_its_process_group() -> None:
    """The copy-out's `group` (FSDP2's dp group from the device mesh) follows the COMM entry, so
    the wait counts for that group (on the GPU too: the replay splits device comm by group)."""
    probe = Probe()
    stream = _Stream(probe, [])
    stub = SimpleNamespace(
        _C=SimpleNamespace(_current_graph_task_id=lambda: -1),
        fake=SimpleNamespace(current_stream=lambda: stream),
    )

    import torch

    @torch.no_grad()  # as FSDP2's is: its own signature is (*args, **kwargs)
    def copy_out(all_gather_result: Any, fsdp_params: Any, group: Any) -> None:
        pass

    wrapped = timed_wait(probe, copy_out, cast("ModuleType", stub), lambda: False, "copy_out")
    result = SimpleNamespace(
        all_gather_event="ev", all_gather_output=SimpleNamespace(device=SimpleNamespace(type="fake"))
    )
    wrapped(result, [], SimpleNamespace(group_desc="mesh_dp"))
    assert probe.failures == 0
    assert _codes(probe) == [COMM, EXIT | COMM]
    assert probe.log[3] == (COMM_GROUP, "dp")
