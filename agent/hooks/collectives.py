"""Collective wait on the training thread: the `comm` phase.

Two places where a rank waits for the others, both timed with the probe's own entries:

- Blocking collectives called from Python on the training thread (`dist.all_reduce`, `barrier`,
  `all_gather_into_tensor`, ..., and DDP's buffer broadcast `dist._broadcast_coalesced`): each
  is a `comm` phase, wrapped like the other hooks (timed.py). A call with `async_op=True` passes
  straight through: it only enqueues, and its `wait()` is a C++ method we do not wrap.
- The end of a backward pass. DDP's reducer launches each bucket's all-reduce as the bucket's
  gradients are ready, then waits for all of them in `finalize_backward`, an autograd final
  callback it queues when its last bucket is ready (FSDP queues one too). On a timed step of a
  distributed run, the backward wrapper puts a pre-hook on the loss's grad_fn (the first node
  the engine runs), which queues our own final callback before theirs: it logs COMM_READY when
  the backward's compute is done, so the rest of the backward is the wait. On gloo that wait
  blocks the training thread; on NCCL only the compute stream waits, which the CUDA events of
  a sampled step show (the callback runs on the caller's current stream, where `put` records).

What it costs: one attribute test per timed backward when no process group is in use. In a
distributed run the pre-hook's registration, queue_callback and our callback cost about twice
what timing the step does (docs/benchmarks.md), so such a run times a third as many fast steps
(phase_sampling.COMM_FULL_STEP_NS).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any

from torchtop.agent.hooks.groups import log_group, watch_meshes
from torchtop.agent.hooks.probe import current
from torchtop.agent.hooks.timed import _TIMED
from torchtop.agent.hooks.wrap import mirror, note_phase, signature_wrapper
from torchtop.contract.logcodes import BACKWARD, COMM, COMM_READY, EXIT

if TYPE_CHECKING:
    from torchtop.agent.hooks.probe import Probe

# the blocking collectives of torch.distributed a training loop calls itself (FSDP and DDP go
# through these or through C++; `_broadcast_coalesced` is DDP's per-forward buffer sync)
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
    "barrier",
    "monitored_barrier",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "all_gather_object",
    "broadcast_object_list",
    "_broadcast_coalesced",
)

# the backward wrapper: timed.py's template, arming the collective-wait callback after its entry;
# while no optimizer has stepped (`no_opt`), an outermost backward's end may end the step
# (probe.backward_ended; `_tt_task()` is -1 outside the autograd engine: not a nested backward)
_BACKWARD = (
    _TIMED.replace(
        "        _tt_put(_tt_enter)\n",
        "        _tt_put(_tt_enter)\n        if _tt_probe.comm:\n            _tt_arm({first})\n"
        "            _tt_probe.engine = True\n",
        1,
    )
    .replace(  # the engine's thread logs waits only while a timed backward runs (waits.py)
        "    finally:\n        try:\n",
        "    finally:\n        _tt_probe.engine = False\n        try:\n",
        1,
    )
    .replace("_tt_probe.adopt()", "_tt_probe.adopt(True)", 1)
    .replace(  # a backward claims the training thread
        "            _tt_put(_tt_leave)\n",
        "            _tt_put(_tt_leave)\n"
        "            if _tt_probe.no_opt and _tt_task() < 0:\n"
        "                _tt_probe.backward_ended()\n",
        1,
    )
)
assert "backward_ended" in _BACKWARD and "adopt(True)" in _BACKWARD
assert _BACKWARD.count("_tt_probe.engine") == 2
_ASYNC = _TIMED.replace("if _tt_probe.untimed or", "if _tt_probe.untimed or async_op or", 1)
# a collective that takes `group`: its process group named after the entry (groups.py)
_GROUP = "        _tt_put(_tt_enter)\n        _tt_group(_tt_probe, group)\n"


def timed_backward(
    probe: Probe, orig: Any, arm: Callable[[Any], None], task: Callable[[], int] = lambda: -1
) -> Any:
    """`torch.autograd.backward` timed as BACKWARD; on a distributed run (`probe.comm`), with
    the end-of-backward callback armed (`arm(tensors)`). `task`: the autograd engine's graph
    task (-1 outside a backward: torch._C._current_graph_task_id)."""
    names = {
        "_tt_current": current,
        "_tt_probe": probe,
        "_tt_pc": perf_counter_ns,
        "_tt_enter": BACKWARD,
        "_tt_leave": EXIT | BACKWARD,
        "_tt_arm": arm,
        "_tt_task": task,
    }
    # its frame says "backward" to the stack sampler on untimed steps too (nothing is logged there)
    return note_phase(
        signature_wrapper(orig, _BACKWARD, names, getattr(orig, "__name__", "backward")), BACKWARD
    )


def timed_collective(probe: Probe, orig: Any) -> Any:
    """A blocking collective timed as COMM; one called with async_op=True passes through."""
    names = {
        "_tt_current": current,
        "_tt_probe": probe,
        "_tt_pc": perf_counter_ns,
        "_tt_enter": COMM,
        "_tt_leave": EXIT | COMM,
    }
    params = _parameters(orig)
    template = _ASYNC if "async_op" in params else _TIMED
    if "group" in params and mirror(orig, True) is not None:  # `group` is a name in the wrapper
        template = template.replace("        _tt_put(_tt_enter)\n", _GROUP, 1)
        names["_tt_group"] = log_group
    # its frame says "comm" to the stack sampler on untimed steps too, and names the collective
    return note_phase(
        signature_wrapper(orig, template, names, getattr(orig, "__name__", "collective"), True), COMM
    )


def _parameters(fn: Any) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(fn, follow_wrapped=True).parameters)
    except (TypeError, ValueError):
        return ()


class BackwardWait:
    """Arms, on the training thread, the autograd final callback that logs COMM_READY."""

    def __init__(self, probe: Probe, torch: Any) -> None:
        self.probe = probe
        self._queue = torch.autograd.Variable._execution_engine.queue_callback
        self._tensor = torch.Tensor

    def _ready(self) -> None:
        """The final callback: every gradient of this backward is computed (the engine runs
        final callbacks in order: this one before DDP's finalize_backward)."""
        try:
            put = self.probe.put
            put(perf_counter_ns())
            put(COMM_READY)
        except Exception:  # broad: never into the training loop (probe.fail counts it)
            self.probe.fail()

    def _pre(self, grad_outputs: Any) -> None:
        """The loss's grad_fn pre-hook: the engine is running this backward now."""
        try:
            self._queue(self._ready)
        except Exception:  # broad: never into the training loop (probe.fail counts it)
            self.probe.fail()

    def arm(self, tensors: Any) -> None:
        """Before a timed backward of a distributed run: hook the first node it will run."""
        try:
            t = tensors if isinstance(tensors, self._tensor) else next(iter(tensors), None)
            fn = getattr(t, "grad_fn", None)
            if fn is not None:
                fn.register_prehook(self._pre)
        except Exception:  # broad: never into the training loop (probe.fail counts it)
            self.probe.fail()


def patch_collectives(probe: Probe, torch: Any, setattr_: Callable[[Any, str, Any], None]) -> int:
    """Wrap torch.distributed's blocking collectives as COMM; how many were wrapped."""
    dist = getattr(torch, "distributed", None)
    try:
        if dist is None or not dist.is_available():
            return 0
    except Exception:  # broad: a torch without distributed may raise anything: nothing to patch
        return 0
    watch_meshes(torch, setattr_)
    n = 0
    for name in COLLECTIVES:
        orig = getattr(dist, name, None)
        if callable(orig):
            setattr_(dist, name, timed_collective(probe, orig))
            n += 1
    return n
