"""The wrappers that time a call on the training thread: the hottest code torchtop has.

Each is generated with the wrapped function's own signature (wrap.py) from a template: a
check that this step is timed (`probe.untimed`: phase sampling) and that this is the training
thread (a context variable), then a time and a code on each side (`probe.put`), with no call
layer of ours in between. Every operation here was chosen by timing
it right after a matmul, as it runs in a training loop (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter_ns
from typing import TYPE_CHECKING

from torchtop.agent.hooks.probe import Probe, current
from torchtop.agent.hooks.work import log_work
from torchtop.agent.hooks.wrap import Fn, note_phase, signature_wrapper
from torchtop.contract.logcodes import EXIT, FORWARD

if TYPE_CHECKING:
    import weakref
    from types import ModuleType

    from torch import nn

_TIMED = """
def {name}({params}):
    if _tt_probe.untimed or (_tt_current() is not _tt_probe and _tt_probe.adopt() is None):
        return _tt_orig({call})  # a step whose phases are not timed, or another thread
    try:  # free in CPython 3.11+ until it catches
        _tt_put = _tt_probe.put
        _tt_put(_tt_pc())
        _tt_put(_tt_enter)
    except Exception:
        _tt_probe.fail()
    try:
        return _tt_orig({call})
    finally:
        try:
            _tt_put = _tt_probe.put
            _tt_put(_tt_pc())
            _tt_put(_tt_leave)
        except Exception:
            _tt_probe.fail()
"""


def timed(probe: Probe, phase: int, orig: Fn, enter: int | None = None, events: bool = True) -> Fn:
    """`orig` wrapped so that its time on the training thread counts as `phase`.

    The hottest code torchtop has: a context-variable check that this is the training thread,
    then a time and a code on each side (`probe.put`), with orig's own signature and no call
    layer of ours in between (wrap.py). The try blocks are free in CPython 3.11 until they
    catch; nothing can raise into the user's code. Without `events` (the data wait: no device
    work of its own) an event step records no CUDA event there (`probe._append`, not `put`).
    """
    names = {
        "_tt_current": current,
        "_tt_probe": probe,
        "_tt_pc": perf_counter_ns,
        "_tt_enter": phase if enter is None else enter,
        "_tt_leave": EXIT | phase,
    }
    template = _TIMED if events else _TIMED.replace("_tt_probe.put", "_tt_probe._append")
    return note_phase(signature_wrapper(orig, template, names, getattr(orig, "__name__", "wrapper")), phase)


_FORWARD = """
def {name}({params}):
    if _tt_dynamo():  # first: under dynamo it is a constant and nothing else here is traced
        return _tt_orig({call})
    _tt_p = _tt_probe
    if _tt_p.untimed >= 2 and _tt_grad():  # UNTIMED: a step whose phases are not timed (sampling)
        return _tt_orig({call})
    if {first} is _tt_root[0]():
        _tt_code = _tt_root[1]
    else:  # another root of this class (rare), or not a root
        _tt_code = _tt_others.get(_tt_id({first}))
        if _tt_code is None:
            return _tt_orig({call})
    if _tt_p.depth or (_tt_current() is not _tt_p and _tt_p.adopt() is None):
        return _tt_orig({call})  # nested in a root, or another thread
    if _tt_p.untimed:  # a no-grad forward while untimed (evaluation?), or WAKE: no step ended for 1 s
        if _tt_p.untimed >= 2:
            _tt_p.nograd_untimed(_tt_code)
        else:
            _tt_p.wake()
    _tt_p.depth = 1
    try:
        _tt_put = _tt_p.put
        _tt_put(_tt_pc())
        _tt_put(_tt_code + _tt_grad())
        if not _tt_p.untimed:  # a timed step: what the batch holds (hooks/work.py)
            _tt_work(_tt_p, {call})
    except Exception:
        _tt_p.fail()
    try:
        return _tt_orig({call})
    finally:
        _tt_p.depth = 0
        try:
            _tt_put = _tt_p.put
            _tt_put(_tt_pc())
            _tt_put(_tt_leave)
        except Exception:
            _tt_p.fail()
"""


def dynamo_check(torch: ModuleType) -> Callable[[], bool]:
    """A check that is True while dynamo traces: `is_dynamo_compiling` (one frame that returns
    False, folded to True by dynamo) where torch has it, else `is_compiling` (two frames)."""
    compiler = getattr(torch, "compiler", None)
    fn = getattr(compiler, "is_dynamo_compiling", None) or getattr(compiler, "is_compiling", None)
    return fn if fn is not None else (lambda: False)


def compiling_check(torch: ModuleType) -> Callable[[], bool]:
    fn = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return fn if fn is not None else (lambda: False)


def timed_forward(
    probe: Probe,
    orig: Fn,
    root: list[weakref.ref[nn.Module] | int],
    others: dict[int, int],
    dynamo: Callable[[], bool],
    grad_enabled: Callable[[], bool],
) -> Fn:
    """A root class's `forward` wrapped: `root` is [weakref to its first root, its code],
    `others` the codes of further roots of the class by id (filled in later)."""
    names = {
        "_tt_dynamo": dynamo,
        "_tt_root": root,
        "_tt_others": others,
        "_tt_id": id,
        "_tt_probe": probe,
        "_tt_current": current,
        "_tt_pc": perf_counter_ns,
        "_tt_grad": grad_enabled,
        "_tt_leave": EXIT | FORWARD,
        "_tt_work": log_work,
    }
    return note_phase(signature_wrapper(orig, _FORWARD, names, "forward"), FORWARD)
