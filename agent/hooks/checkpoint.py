"""Saves timed as the `checkpoint` phase: `torch.save`, torch.distributed.checkpoint's `save` and
`async_save` (its staging, on the calling thread, and a later `.result()` on what it returned),
safetensors' `save_file`, and the frameworks' own save methods, whole: Lightning's
`Trainer.save_checkpoint` (its file write follows a `torch.save` into memory) and HF's
`Trainer._save_checkpoint` / `save_model` and `PreTrainedModel.save_pretrained` (which calls
safetensors through a name bound at import, so patching `save_file` alone misses it).

Only the training thread's saves count (a save on another thread, DCP's own upload thread among
them, is not the step's); a save inside a save is timed once. A save is logged on every step,
timed or not (phase sampling), since saves are rare and costly and a sampled step would miss
most of them; nothing is added to a step without a save. The modules are patched as attributes:
a `from torch import save` done before the agent started keeps the original (docs/architecture.md).
torch.distributed.checkpoint, safetensors and the frameworks are patched once imported (the agent
tick looks): importing them ourselves would cost the user's start ~0.6 s.
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
# a framework's module -> its class and the save methods timed whole (a save inside is timed once)
FRAMEWORKS: dict[str, tuple[str, tuple[str, ...]]] = {
    "lightning.pytorch.trainer.trainer": ("Trainer", ("save_checkpoint",)),
    "pytorch_lightning.trainer.trainer": ("Trainer", ("save_checkpoint",)),
    "transformers.trainer": ("Trainer", ("_save_checkpoint", "save_model")),
    "transformers.modeling_utils": ("PreTrainedModel", ("save_pretrained",)),
}


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
        """Agent thread: patch the savers imported since (a few dict lookups until all are)."""
        if DCP not in self._done and DCP_SAVER in sys.modules and DCP in sys.modules:
            self._done.add(DCP)
            for mod in (sys.modules[DCP_SAVER], sys.modules[DCP]):
                self._patch(mod, "save")
                self._patch(mod, "async_save", self._time_wait)
        if SAFETENSORS not in self._done and SAFETENSORS in sys.modules:
            self._done.add(SAFETENSORS)
            self._patch(sys.modules[SAFETENSORS], "save_file")
        for name, (cls_name, methods) in FRAMEWORKS.items():
            if name not in self._done and name in sys.modules:
                self._done.add(name)
                cls = getattr(sys.modules[name], cls_name, None)
                for method in methods if isinstance(cls, type) else ():
                    if method in cls.__dict__:  # defined there: a subclass's own is left alone
                        self._patch(cls, method)

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
