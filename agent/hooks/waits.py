"""Collective waits wherever they happen: `Work.wait`, functional collectives, FSDP2's unshard.

The `comm` phase from the points where a rank blocks on communication it did not hide, nested
inside whatever phase is open (FSDP2's all-gather inside forward, its reduce-scatter inside
backward): the replay pauses that phase for it, so forward and backward keep only their compute.

- `Work.wait` (torch's C++ class, patched on the class): every blocking collective of
  torch.distributed ends in it (c10d's Python calls `work.wait()` when `async_op` is False), as
  does a user's `async_op=True` collective, pipelining's send/recv, and FSDP2's all-gather and
  reduce-scatter. On gloo the training thread blocks there: host time. On NCCL it only makes the
  current stream wait: a sampled step's CUDA events around it show that stream's wait.
- `torch.distributed._functional_collectives.wait_tensor`: where tensor parallel (DTensor) and
  functional collectives wait (an AsyncCollectiveTensor's first use).
- On CUDA, FSDP2's all-gather copy-out (`foreach_all_gather_copy_out`, from wait_for_unshard):
  the compute stream's wait for the all-gather stream (an event, not `Work.wait`) is made first
  and timed alone, named by the all-gather's group; the copies stay in their phase. Another torch
  without that function: the whole `wait_for_unshard`.
- On CUDA the autograd engine runs backward nodes on a thread of its own (FSDP2's backward
  all-gathers wait there): during a timed backward of a distributed run (`probe.engine`) the
  wait hooks log from a thread inside the engine (its graph task id >= 0) as well.
- `torch.distributed.pipelining.schedules._wait_batch_p2p`: where a pipeline schedule waits for
  its neighbour stages' send/recv (the bubble). Timed as COMM around the `Work.wait`s it makes,
  with a COMM_GROUP entry named PIPELINE (logcodes.py): the replay counts it apart from the
  collectives, whatever the mesh calls the stage group. An empty list (no send in flight) passes.
  Its `_batch_p2p`, which posts them, likewise: on gloo an isend/irecv blocks in the call on the
  transport's thread (milliseconds a step on a loaded host); on NCCL it launches. The stage's
  own work in the schedule (its chunks, the loss) is timed by pipeline.py.

Each is timed like the other hooks (timed.py: only on timed steps, only on the training thread),
with a dynamo check first so that compiled code traces straight through. Modules a job imports
after start() (DTensor, FSDP2) are patched from the agent thread once they are imported.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any, Literal

from torchtop.agent.hooks.collectives import _GROUP
from torchtop.agent.hooks.funcol_groups import GROUP_ENTRY, patch_resolver
from torchtop.agent.hooks.groups import log_group
from torchtop.agent.hooks.pipeline import patch_pipeline_work
from torchtop.agent.hooks.probe import current
from torchtop.agent.hooks.timed import _TIMED, dynamo_check
from torchtop.agent.hooks.wrap import mirror, note_phase, signature_wrapper
from torchtop.contract.logcodes import COMM, COMM_GROUP, EXIT, PIPELINE

if TYPE_CHECKING:
    from types import ModuleType

    from torchtop.agent.hooks.probe import Probe

# the training thread, or the autograd engine's thread while a timed backward runs (on CUDA the
# engine runs backward nodes there: FSDP2's backward all-gathers, DDP's bucket waits)
_ENGINE = "_tt_current() is not _tt_probe and not (_tt_probe.engine and _tt_task() >= 0) and"
_WAIT = _TIMED.replace(
    "    if _tt_probe.untimed or",
    "    if _tt_dynamo():\n        return _tt_orig({call})\n    if _tt_probe.untimed or",
    1,
).replace("_tt_current() is not _tt_probe and", _ENGINE, 1)
assert _ENGINE in _WAIT
# FSDP2's copy-out of an all-gather (`foreach_all_gather_copy_out`, called by wait_for_unshard): the
# compute stream's wait for the all-gather stream is timed alone as COMM (the same `wait_event`,
# made first; the original's own is then a no-op), its copies stay in the phase around it
_COPY_OUT = """
def {name}({params}):
    if _tt_dynamo():
        return _tt_orig({call})
    if _tt_probe.untimed or (ENGINE _tt_probe.adopt() is None):
        return _tt_orig({call})
    _tt_ev = _tt_event({first})  # after the cheap tests: it looks up the current stream
    if _tt_ev is None:
        return _tt_orig({call})
    try:
        _tt_put = _tt_probe.put
        _tt_put(_tt_pc())
        _tt_put(_tt_enter)
    except Exception:
        _tt_probe.fail()
    try:
        _tt_ev[0].wait_event(_tt_ev[1])
    except Exception:
        pass  # the original waits all the same
    try:
        _tt_put = _tt_probe.put
        _tt_put(_tt_pc())
        _tt_put(_tt_leave)
    except Exception:
        _tt_probe.fail()
    return _tt_orig({call})
""".replace("ENGINE", _ENGINE)
# the schedule's wait on a list of P2P works: a COMM named PIPELINE; an empty list is no wait
_PIPE_WAIT = _WAIT.replace(
    "    if _tt_probe.untimed or", "    if not {first} or _tt_probe.untimed or", 1
).replace(
    "        _tt_put(_tt_enter)\n",
    "        _tt_put(_tt_enter)\n        _tt_probe._append(_tt_pc())\n        _tt_probe._append(_tt_pipe)\n",
    1,
)
assert "_tt_pipe" in _PIPE_WAIT and "not {first}" in _PIPE_WAIT
FUNCOL = "torch.distributed._functional_collectives"
PIPELINING = "torch.distributed.pipelining.schedules"
FSDP2 = "torch.distributed.fsdp._fully_shard._fsdp_param_group"
COPY_OUT = "foreach_all_gather_copy_out"  # FSDP2's copy-out, a global of FSDP2's module


def _graph_task(torch: ModuleType) -> Callable[[], int]:
    """The autograd engine's graph task on this thread (-1 outside a backward)."""
    return getattr(torch._C, "_current_graph_task_id", None) or (lambda: -1)


def _all_gather_event(torch: ModuleType) -> Callable[[Any], tuple[Any, Any] | None]:
    """(the current stream, the event it must wait for) of an FSDP2 all-gather result, or None
    (an async all-gather waits in `Work.wait`, timed there; a CPU one has no stream)."""

    def event(result: Any) -> tuple[Any, Any] | None:
        ev = getattr(result, "all_gather_event", None)
        if ev is None:
            return None
        device = getattr(getattr(result, "all_gather_output", None), "device", None)
        handle = getattr(torch, getattr(device, "type", ""), None)
        current_stream = getattr(handle, "current_stream", None)
        return None if current_stream is None else (current_stream(), ev)

    return event


How = Literal["wait", "pipeline", "copy_out", "funcol"]


def timed_wait(
    probe: Probe, orig: Any, torch: ModuleType, dynamo: Callable[[], bool], how: How = "wait"
) -> Any:
    """`orig` timed as COMM on timed steps of the training thread (and of the autograd engine's
    thread during a timed backward). `how`: "wait" (the call is the wait), "pipeline" (a
    pipeline schedule's wait for its neighbour stages; its first argument: the works),
    "copy_out" (FSDP2's all-gather copy-out: only the stream's wait in it), or "funcol" (a
    functional collective's wait, named by the group its issue left: funcol_groups.py)."""
    names: dict[str, Any] = {
        "_tt_dynamo": dynamo,
        "_tt_task": _graph_task(torch),
        "_tt_event": _all_gather_event(torch),
        "_tt_current": current,
        "_tt_probe": probe,
        "_tt_pc": perf_counter_ns,
        "_tt_enter": COMM,
        "_tt_leave": EXIT | COMM,
        "_tt_pipe": (COMM_GROUP, PIPELINE),
    }
    template = {"wait": _WAIT, "pipeline": _PIPE_WAIT, "copy_out": _COPY_OUT, "funcol": _WAIT}[how]
    if how == "funcol":
        template = template.replace("        _tt_put(_tt_enter)\n", GROUP_ENTRY, 1)
        names["_tt_group"] = log_group
    parts = mirror(orig, True)
    params = [] if parts is None else [p.split("=")[0].lstrip("*") for p in parts[0].split(", ")]
    if how == "copy_out" and "group" in params:
        # the all-gather's process group (dp from the device mesh...): the wait counts for it
        template = template.replace("        _tt_put(_tt_enter)\n", _GROUP, 1)
        names["_tt_group"] = log_group
    # FSDP2's copy-out is wrapped in torch.no_grad(): its own signature is (*args, **kwargs)
    fn = signature_wrapper(orig, template, names, getattr(orig, "__name__", "wait"), how == "copy_out")
    return note_phase(fn, COMM)


class Waits:
    """Installs the wait hooks: `Work.wait` at once, the others as their modules appear."""

    def __init__(self, probe: Probe, torch: ModuleType, setattr_: Callable[[Any, str, Any], None]) -> None:
        self.probe = probe
        self.torch = torch
        self._setattr = setattr_
        self._dynamo = dynamo_check(torch)
        self.patched: set[str] = set()

    def install(self) -> None:
        dist = getattr(self.torch, "distributed", None)
        try:
            if dist is None or not dist.is_available():
                return
            work = dist.distributed_c10d.Work
        except Exception:  # broad: a torch without distributed may raise anything: nothing to patch
            return
        self._patch(work, "wait", "Work.wait")
        self.tick()

    def tick(self) -> None:
        """Agent thread (and at install): patch the modules imported since."""
        if FUNCOL not in self.patched:
            funcol = sys.modules.get(FUNCOL)
            if funcol is not None:
                self._patch(funcol, "wait_tensor", FUNCOL, "funcol")
                try:  # where each collective's group is resolved at its issue: names its wait
                    patch_resolver(self.probe, self.torch, funcol, self._setattr)
                except Exception:  # broad: torch internals vary by version: the waits stay unnamed
                    pass  # its waits stay in comm, unnamed
        if FSDP2 not in self.patched:
            module = sys.modules.get(FSDP2)
            group = getattr(module, "FSDPParamGroup", None)
            if group is not None:
                if not self._cuda():  # on CPU its wait is Work.wait's, and the rest is copies
                    self.patched.add(FSDP2)
                elif callable(getattr(module, COPY_OUT, None)):
                    self._patch(module, COPY_OUT, FSDP2, "copy_out")
                else:  # another torch: the whole unshard wait, its copy-out included
                    self._patch(group, "wait_for_unshard", FSDP2)
        if PIPELINING not in self.patched:
            schedules = sys.modules.get(PIPELINING)
            # a module still being imported (by the training thread) may not define it yet
            if callable(getattr(schedules, "_wait_batch_p2p", None)):
                self._patch(schedules, "_wait_batch_p2p", PIPELINING, "pipeline")
                # posting them: on gloo a send or recv blocks there on the transport's thread
                self._patch(schedules, "_batch_p2p", PIPELINING, "pipeline")
                # the stage's forward and backward chunks and the loss, as their phases (pipeline.py)
                patch_pipeline_work(self.probe, self._setattr, self._dynamo)

    def _cuda(self) -> bool:
        try:
            return bool(self.torch.cuda.is_available())
        except Exception:  # broad: a torch without usable CUDA may raise anything: no CUDA
            return False

    def _patch(self, owner: Any, name: str, key: str, how: How = "wait") -> None:
        self.patched.add(key)
        orig = getattr(owner, name, None)
        if not callable(orig):
            return
        try:
            self._setattr(owner, name, timed_wait(self.probe, orig, self.torch, self._dynamo, how))
        except Exception:  # broad: a class may refuse new attributes any way
            pass  # a class that refuses new attributes: its waits stay in their phase
