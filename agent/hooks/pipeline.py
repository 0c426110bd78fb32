"""A pipeline stage's own work inside its schedule: forward and backward chunks, the loss.

A schedule of `torch.distributed.pipelining` (GPipe, 1F1B, the zero-bubble and multi-stage
ones) runs each micro-batch through its stage as `forward_one_chunk` and `backward_one_chunk`
(`backward_weight_one_chunk` where it splits the weight gradients off), computes the loss on the
last stage in `_compute_loss`, and ends the step's backward with `perform_reduce_grad` (FSDP's
post-backward, the gradients scaled by the number of micro-batches). Only part of that is inside
what the other hooks time: the stage module's forward (a root found by auto.py) and the
`torch.autograd.backward` of `stage_backward`. The rest read as `other`: the loss (the loss
function is no root module), the chunk's bookkeeping around the module (the inputs it receives,
the activations it keeps, their detach), the gradients' scaling. On the last stage, which alone
computes the loss and sends input gradients, that made `other` the phase that set it apart.

Each of these methods is timed here as its phase (timed.py's template, with waits.py's dynamo
check first), on the class that defines it, once the modules are imported (waits.py's agent-thread
tick). The hooks inside nest: the root forward inside a forward chunk, `autograd.backward` and
the send/recv waits (`comm`, waits.py) inside a backward chunk; the replay pauses the outer phase
for a nested one and counts only an outermost backward as a micro-batch. A chunk records no CUDA
event of its own on an event step (the nested forward and backward do), so the device time of a
phase is not counted twice; the loss and the gradients' scaling, which nest in nothing, do.
`backward_weight_one_chunk` and `perform_reduce_grad` open the backward as `autograd.grad` does:
backward time, not another micro-batch. Posting the schedule's send/recv (`_batch_p2p`) is the
pipeline's `comm` (waits.py: on gloo a send or recv blocks there on the transport). What stays
`other` is the schedule's own loop: building the send/recv ops, splitting the batch into
micro-batches, merging the last stage's outputs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any

from torchtop.agent.hooks.probe import current
from torchtop.agent.hooks.timed import _TIMED
from torchtop.agent.hooks.wrap import note_phase, signature_wrapper
from torchtop.contract.logcodes import BACKWARD, EXIT, FORWARD, GRAD

if TYPE_CHECKING:
    from torchtop.agent.hooks.probe import Probe

STAGE = "torch.distributed.pipelining.stage"
SCHEDULES = "torch.distributed.pipelining.schedules"
# (module, class, method, phase, the code that opens it, CUDA events on an event step)
WORK: tuple[tuple[str, str, str, int, int, bool], ...] = (
    (STAGE, "_PipelineStageBase", "forward_one_chunk", FORWARD, FORWARD, False),
    (STAGE, "_PipelineStageBase", "backward_one_chunk", BACKWARD, BACKWARD, False),
    (STAGE, "_PipelineStageBase", "backward_weight_one_chunk", BACKWARD, GRAD, False),
    (STAGE, "_PipelineStageBase", "perform_reduce_grad", BACKWARD, GRAD, True),
    (SCHEDULES, "_PipelineSchedule", "_compute_loss", FORWARD, FORWARD, True),
)
_CHUNK = _TIMED.replace(
    "    if _tt_probe.untimed or",
    "    if _tt_dynamo():\n        return _tt_orig({call})\n    if _tt_probe.untimed or",
    1,
)
assert "_tt_dynamo()" in _CHUNK


def timed_chunk(
    probe: Probe, orig: Any, phase: int, enter: int, events: bool, dynamo: Callable[[], bool]
) -> Any:
    """`orig` (a stage's or a schedule's method) timed as `phase`, opened with `enter`."""
    names: dict[str, Any] = {
        "_tt_dynamo": dynamo,
        "_tt_current": current,
        "_tt_probe": probe,
        "_tt_pc": perf_counter_ns,
        "_tt_enter": enter,
        "_tt_leave": EXIT | phase,
    }
    template = _CHUNK if events else _CHUNK.replace("_tt_probe.put", "_tt_probe._append")
    fn = signature_wrapper(orig, template, names, getattr(orig, "__name__", "chunk"))
    return note_phase(fn, phase)


def patch_pipeline_work(
    probe: Probe, setattr_: Callable[[Any, str, Any], None], dynamo: Callable[[], bool]
) -> bool:
    """Wrap the stage's and the schedule's methods of WORK once both modules are imported (the
    schedules module imports the stage's); False while they are not (call again later). A method
    this torch lacks, or one already ours, is left as it is."""
    schedules = sys.modules.get(SCHEDULES)
    # a module still being imported (by the training thread) may not define its classes yet
    if schedules is None or not callable(getattr(schedules, "_wait_batch_p2p", None)):
        return False
    for module_name, cls_name, name, phase, enter, events in WORK:
        try:
            cls = getattr(sys.modules.get(module_name), cls_name, None)
            orig = cls.__dict__.get(name) if isinstance(cls, type) else None
            if not callable(orig) or getattr(orig, "_tt_pipeline", False):
                continue
            fn = timed_chunk(probe, orig, phase, enter, events, dynamo)
            fn._tt_pipeline = True  # type: ignore[attr-defined]
            setattr_(cls, name, fn)
        except Exception:  # broad: torch internals vary by version: that chunk stays untimed
            pass  # left untimed: its time stays `other`
    return True
