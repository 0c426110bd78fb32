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
- On CUDA, FSDP2's `FSDPParamGroup.wait_for_unshard`: the compute stream waits there for the
  all-gather stream (an event, not `Work.wait`); its copy-out, a few memcpys, counts with it.
- `torch.distributed.pipelining.schedules._wait_batch_p2p`: where a pipeline schedule waits for
  its neighbour stages' send/recv (the bubble). Timed as COMM around the `Work.wait`s it makes,
  with a COMM_GROUP entry named PIPELINE (logcodes.py): the replay counts it apart from the
  collectives, whatever the mesh calls the stage group. An empty list (no send in flight) passes.

Each is timed like the other hooks (timed.py: only on timed steps, only on the training thread),
with a dynamo check first so that compiled code traces straight through. Modules a job imports
after start() (DTensor, FSDP2) are patched from the agent thread once they are imported.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any

from torchtop.agent.hooks.probe import current
from torchtop.agent.hooks.timed import _TIMED, dynamo_check
from torchtop.agent.hooks.wrap import note_phase, signature_wrapper
from torchtop.contract.logcodes import COMM, COMM_GROUP, EXIT, PIPELINE

if TYPE_CHECKING:
    from types import ModuleType

    from torchtop.agent.hooks.probe import Probe

_WAIT = _TIMED.replace(
    "    if _tt_probe.untimed or",
    "    if _tt_dynamo():\n        return _tt_orig({call})\n    if _tt_probe.untimed or",
    1,
)
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


def timed_wait(probe: Probe, orig: Any, dynamo: Callable[[], bool], pipeline: bool = False) -> Any:
    """`orig` timed as COMM on timed steps of the training thread; with `pipeline`, a pipeline
    schedule's wait for its neighbour stages (its first argument: the works)."""
    names: dict[str, Any] = {
        "_tt_dynamo": dynamo,
        "_tt_current": current,
        "_tt_probe": probe,
        "_tt_pc": perf_counter_ns,
        "_tt_enter": COMM,
        "_tt_leave": EXIT | COMM,
        "_tt_pipe": (COMM_GROUP, PIPELINE),
    }
    template = _PIPE_WAIT if pipeline else _WAIT
    fn = signature_wrapper(orig, template, names, getattr(orig, "__name__", "wait"))
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
        except Exception:
            return
        self._patch(work, "wait", "Work.wait")
        self.tick()

    def tick(self) -> None:
        """Agent thread (and at install): patch the modules imported since."""
        if FUNCOL not in self.patched:
            funcol = sys.modules.get(FUNCOL)
            if funcol is not None:
                self._patch(funcol, "wait_tensor", FUNCOL)
        if FSDP2 not in self.patched:
            group = getattr(sys.modules.get(FSDP2), "FSDPParamGroup", None)
            if group is not None:
                if self._cuda():  # on CPU its wait is Work.wait's, and the rest is copies
                    self._patch(group, "wait_for_unshard", FSDP2)
                else:
                    self.patched.add(FSDP2)
        if PIPELINING not in self.patched:
            schedules = sys.modules.get(PIPELINING)
            # a module still being imported (by the training thread) may not define it yet
            if callable(getattr(schedules, "_wait_batch_p2p", None)):
                self._patch(schedules, "_wait_batch_p2p", PIPELINING, True)

    def _cuda(self) -> bool:
        try:
            return bool(self.torch.cuda.is_available())
        except Exception:
            return False

    def _patch(self, owner: Any, name: str, key: str, pipeline: bool = False) -> None:
        self.patched.add(key)
        orig = getattr(owner, name, None)
        if not callable(orig):
            return
        try:
            self._setattr(owner, name, timed_wait(self.probe, orig, self._dynamo, pipeline))
        except Exception:
            pass  # a class that refuses new attributes: its waits stay in their phase
