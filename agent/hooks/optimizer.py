"""Optimizer steps: the optimizer phase, and where a training step ends.

Our wrapper goes into the closure cell of torch's own step wrapper (`profile_hook_step`), so it
runs between the step hooks wherever torch's wrapper runs, and once for a subclass's
`super().step()`; classes wrapped after start() are caught at `_patch_step_function`, and
another torch falls back to global step hooks (docs/architecture.md, "The step model"). With one
optimizer (`probe.opt_fast`) the optimizer carries an attribute naming the probe (cheaper than a
weakref call) and its STEP_END closes the phase and the step at once. No compiling() check:
dynamo breaks the graph at the context-variable read, so this always runs eagerly.
"""

from __future__ import annotations

import weakref
from time import perf_counter_ns
from types import CellType, ModuleType
from typing import TYPE_CHECKING, Any

from torchtop.agent.hooks.probe import Probe, current
from torchtop.agent.hooks.wrap import Fn, SetAttr, Undo, note_phase, signature_wrapper
from torchtop.contract.logcodes import OPTIMIZER, STEP_END, UNTIMED_END

if TYPE_CHECKING:
    from torch.optim import Optimizer

MARK = "_torchtop_probe"  # on the one optimizer: the probe whose fast path it takes
_OURS = "_torchtop_step"  # on our wrapper: never wrapped twice

_STEP = """
def {name}({params}):
    _tt_p = _tt_probe
    if _tt_p.opt_depth or (_tt_current() is not _tt_p and _tt_p.adopt(True) is None):
        return _tt_orig({call})  # nested in a step (a subclass's super().step()), another thread
    if {first}._torchtop_probe is not _tt_p or not _tt_p.opt_fast:
        return _tt_any(_tt_orig, {call})
    _tt_p.opt_depth = 1
    if not _tt_p.untimed:  # an untimed step (phase sampling) logs only its end
        try:
            _tt_put = _tt_p.put
            _tt_put(_tt_pc())
            _tt_put(_tt_enter)
        except Exception:
            _tt_p.fail()
    try:
        _tt_out = _tt_orig({call})
    finally:
        _tt_p.opt_depth = 0
    _tt_p.opt_ran = True
    try:  # probe.cut(STEP_END), inlined: a Python frame less at every step
        _tt_put = _tt_p.put
        _tt_put(_tt_pc())
        _tt_put(_tt_untimed_end if _tt_p.untimed else _tt_end)
        _tt_p.left -= 1
        if _tt_p.left <= 0 or _tt_p.on_step is not None:
            _tt_p.housekeep()
        else:
            _tt_p.untimed = _tt_p.plan[_tt_p.left]
    except Exception:
        _tt_p.fail()
    return _tt_out
"""


class OptimizerSteps:
    """Times optimizer steps for one probe and cuts training steps after them."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self._seen: set[int] = set()  # optimizers of the current cycle (several optimizers)
        self._stepped: set[int] = set()
        self._marked: list[weakref.ref[Optimizer]] = []  # optimizers that carry MARK
        self._cells: list[tuple[CellType, Fn]] = []  # (cell, the step it held) we filled

    # -- install / uninstall -------------------------------------------------------------------
    def install(self, setattr_: SetAttr, undo: Undo) -> None:
        import torch.optim.optimizer as optim_mod  # torch.optim dels the name `optimizer`

        base = optim_mod.Optimizer
        setattr_(base, MARK, None)  # unmarked optimizers read None
        if _step_cell(base.profile_hook_step(_nothing)) is None:  # not the torch we know
            self._install_global(optim_mod, undo)
            return
        undo(self._restore_cells)
        for cls in _subclasses(base):
            self._wrap_class(cls)
        orig = base.__dict__["_patch_step_function"]
        steps = self

        def _patch_step_function(opt: Optimizer) -> None:  # once per optimizer, at its __init__
            orig(opt)
            try:
                steps._wrap_class(type(opt))
            except Exception:  # broad: never into the training loop (probe.fail counts it)
                steps.probe.fail()

        setattr_(base, "_patch_step_function", _patch_step_function)

    def _wrap_class(self, cls: type) -> None:
        """Time the step of `cls` (or the class it inherits its step from) if torch wrapped it."""
        for klass in cls.__mro__:
            fn = klass.__dict__.get("step")
            if fn is None:
                continue
            if not getattr(fn, "hooked", False):
                return  # not wrapped by torch (yet): no hooks run, nothing to time
            cell = _step_cell(fn)
            if cell is not None and not getattr(cell.cell_contents, _OURS, False):
                inner = cell.cell_contents
                name = getattr(inner, "__name__", "step")
                wrapper = signature_wrapper(inner, _STEP, self._names(), name, follow_wrapped=True)
                note_phase(wrapper, OPTIMIZER)
                setattr(wrapper, _OURS, True)
                self._cells.append((cell, inner))
                cell.cell_contents = wrapper
            return

    def _names(self) -> dict[str, Any]:
        return {
            "_tt_probe": self.probe,
            "_tt_current": current,
            "_tt_pc": perf_counter_ns,
            "_tt_enter": OPTIMIZER,
            "_tt_end": STEP_END,
            "_tt_untimed_end": UNTIMED_END,
            "_tt_any": self._step_any,
        }

    def _restore_cells(self) -> None:
        while self._cells:
            cell, inner = self._cells.pop()
            cell.cell_contents = inner

    def _install_global(self, optim_mod: ModuleType, undo: Undo) -> None:
        """Where torch's wrapper holds no cell: the global step hooks."""
        probe = self.probe

        def pre(opt: Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if current() is probe or probe.adopt(True) is not None:
                self.pre_any(opt)

        def post(opt: Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if current() is probe or probe.adopt(True) is not None:
                probe.opt_ran = True
                self.post(opt)

        undo(optim_mod.register_optimizer_step_pre_hook(pre).remove)
        undo(optim_mod.register_optimizer_step_post_hook(post).remove)

    def uninstall(self) -> None:
        """After the undo list ran: forget the optimizers marked for the fast path."""
        self._restore_cells()
        self.probe.opt_fast = False
        for ref in self._marked:
            opt = ref()
            if opt is not None and opt.__dict__.get(MARK) is self.probe:
                del opt.__dict__[MARK]
        self._marked.clear()

    # -- the general path ----------------------------------------------------------------------
    def _step_any(self, orig: Fn, opt: Optimizer, *args: Any, **kwargs: Any) -> Any:
        """A step off the fast path: the first one, several optimizers, explicit steps."""
        probe = self.probe
        self.pre_any(opt)
        probe.opt_depth = 1
        try:
            out = orig(opt, *args, **kwargs)
        finally:
            probe.opt_depth = 0
        probe.opt_ran = True
        self.post(opt)
        return out

    def pre_any(self, opt: Optimizer) -> None:
        probe = self.probe
        try:
            probe.no_opt = 0  # steps end at the optimizer, not at backwards
            oid = id(opt)
            if oid in self._stepped and not probe.explicit:
                # it stepped twice in one step: the cycle is only what stepped since the last cut
                self._seen = set(self._stepped)
                self._stepped.clear()
                probe.cut()
            if not probe.explicit and (not self._seen or self._seen == {oid}):
                self._go_fast(opt)  # the one optimizer (again): the fast path from now
            self._seen.add(oid)
            probe.enter(OPTIMIZER)
        except Exception:  # broad: never into the training loop (probe.fail counts it)
            probe.fail()

    def post(self, opt: Optimizer) -> None:
        probe = self.probe
        try:
            if getattr(opt, MARK, None) is probe and probe.opt_fast:
                probe.cut(STEP_END)
                return
            probe.opt_fast = False  # another optimizer stepped (or steps are explicit)
            seen = self._seen
            if len(seen) == 1 and id(opt) in seen and not probe.explicit:
                probe.cut(STEP_END)
            else:
                probe.exit(OPTIMIZER)
                self.cycle_done(opt)
        except Exception:  # broad: never into the training loop (probe.fail counts it)
            probe.fail()

    def _go_fast(self, opt: Optimizer) -> None:
        try:
            setattr(opt, MARK, self.probe)
        except Exception:  # broad: an optimizer may refuse attributes any way
            return  # an optimizer that takes no attribute stays on the general path
        self._marked.append(weakref.ref(opt))
        self.probe.opt_fast = True

    def cycle_done(self, opt: Optimizer) -> None:
        """`opt` stepped (or was skipped): end the step once every optimizer of the cycle has."""
        if self.probe.explicit:
            return
        self._seen.add(id(opt))
        self._stepped.add(id(opt))
        if self._stepped >= self._seen:
            self._stepped.clear()
            self.probe.cut()


def _step_cell(fn: Fn) -> CellType | None:
    """The closure cell of torch's step wrapper that holds the real step, or None."""
    code, closure = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or not closure or "func" not in code.co_freevars:
        return None
    cell = closure[code.co_freevars.index("func")]
    try:
        return cell if callable(cell.cell_contents) else None
    except ValueError:  # an empty cell
        return None


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _subclasses(base: type) -> list[type]:
    seen: list[type] = []
    stack = [base]
    while stack:
        for sub in stack.pop().__subclasses__():
            if sub not in seen:
                seen.append(sub)
                stack.append(sub)
    return seen
