"""Saves timed as the `checkpoint` phase: `torch.save`, torch.distributed.checkpoint's `save` and
`async_save` (its staging, on the calling thread, and a later `.result()` on what it returned),
and safetensors' `save_file` (Hugging Face's default weights; Lightning and HF Trainer otherwise
end in `torch.save`).

Only the training thread's saves count (a save on another thread, DCP's own upload thread among
them, is not the step's); a save inside a save is timed once. A save is logged on every step,
timed or not (phase sampling), since saves are rare and costly and a sampled step would miss
most of them; nothing is added to a step without a save. The modules are patched as attributes:
a `from torch import save` done before the agent started keeps the original (docs/architecture.md).
torch.distributed.checkpoint and safetensors are patched once imported (the agent tick looks):
importing them ourselves would cost the user's start ~0.6 s.
"""

from __future__ import annotations

import sys
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any

from torchtop.agent.hooks.probe import Probe, current
from torchtop.agent.hooks.wrap import Fn, SetAttr, note_phase, signature_wrapper
from torchtop.contract.logcodes import EXIT, SAMPLE_CHECKPOINT, SAVE

if TYPE_CHECKING:
    from types import ModuleType

# the training thread's wrapper: no phase-sampling test (every save is logged), a depth guard
_SAVE = """
def {name}({params}):
    if _tt_open[0] or (_tt_current() is not _tt_probe and _tt_probe.adopt() is None):
        return _tt_orig({call})  # nested in a save of ours, or another thread
    _tt_open[0] = 1
    try:
        _tt_put = _tt_probe.put
        _tt_put(_tt_pc())
        _tt_put(_tt_enter)
    except Exception:
        _tt_probe.fail()
    try:
        return _tt_after(_tt_orig({call}))
    finally:
        _tt_open[0] = 0
        try:
            _tt_put = _tt_probe.put
            _tt_put(_tt_pc())
            _tt_put(_tt_leave)
        except Exception:
            _tt_probe.fail()
"""

DCP = "torch.distributed.checkpoint"
DCP_SAVER = "torch.distributed.checkpoint.state_dict_saver"
SAFETENSORS = "safetensors.torch"


def _same(value: Any) -> Any:
    return value


class Saves:
    """The save patches of one probe; `open` is shared by all of them (one save timed at a time)."""

    def __init__(self, probe: Probe, setattr_: SetAttr) -> None:
        self.probe = probe
        self._setattr = setattr_
        self.open = [0]
        self._wrapped: dict[int, Fn] = {}  # id(a module's function) -> its wrapper
        self._done: set[str] = set()

    def timed(self, orig: Fn, after: Any = _same) -> Fn:
        """`orig` timed as a save on the training thread; `after` sees its result (async_save's
        future, to time its wait) and returns what the caller gets."""
        names = {
            "_tt_current": current,
            "_tt_probe": self.probe,
            "_tt_pc": perf_counter_ns,
            "_tt_enter": SAVE,
            "_tt_leave": EXIT | SAVE,
            "_tt_open": self.open,
            "_tt_after": after,
        }
        return note_phase(
            signature_wrapper(orig, _SAVE, names, getattr(orig, "__name__", "save")), SAMPLE_CHECKPOINT
        )

    def _patch(self, owner: object, name: str, after: Any = _same) -> None:
        orig = getattr(owner, name, None)
        if not callable(orig) or getattr(orig, "__code__", None) in _OURS:
            return
        fn = self._wrapped.get(id(orig))  # torch.save is torch.serialization.save: one wrapper
        if fn is None:
            fn = self._wrapped[id(orig)] = self.timed(orig, after)
            _OURS.add(fn.__code__)
        self._setattr(owner, name, fn)

    def install(self, torch: ModuleType) -> None:
        self._patch(torch, "save")
        serialization = getattr(torch, "serialization", None)
        if serialization is not None:
            self._patch(serialization, "save")
        self.tick()

    def tick(self) -> None:
        """Agent thread: patch the savers imported since (two dict lookups until both are)."""
        if DCP not in self._done and DCP_SAVER in sys.modules and DCP in sys.modules:
            self._done.add(DCP)
            for mod in (sys.modules[DCP_SAVER], sys.modules[DCP]):
                self._patch(mod, "save")
                self._patch(mod, "async_save", self._time_wait)
        if SAFETENSORS not in self._done and SAFETENSORS in sys.modules:
            self._done.add(SAFETENSORS)
            self._patch(sys.modules[SAFETENSORS], "save_file")

    def _time_wait(self, out: Any) -> Any:
        """async_save's result: a Future, or an AsyncSaveResponse holding two; each one's
        `result()` (the wait for the upload) is timed as a save on the training thread."""
        try:
            for fut in (
                out,
                getattr(out, "staging_completion", None),
                getattr(out, "upload_completion", None),
            ):
                result = getattr(fut, "result", None)
                if fut is not None and callable(result) and hasattr(fut, "__dict__"):
                    fut.result = self.timed(result)
        except Exception:  # broad: a future we cannot wrap is returned as it is
            self.probe.fail()
        return out


_OURS: set[Any] = set()  # our wrappers' code: a save never wrapped twice (a second agent start)
