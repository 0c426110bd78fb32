"""Zero-code instrumentation: the patches and hooks that feed the StepRecorder.

- DataLoader wait: `_BaseDataLoaderIter.__next__` (shared by single- and multi-process iterators),
  counted only on the training thread.
- forward: one global forward pre-hook finds the root modules (modules with parameters called
  while no root forward is open) during the first steps and removes itself; from then on the
  roots' class `forward` is wrapped (nn.Module keeps its fast call path). Global hooks on every
  module would cost ~1.7 us per module call; instance hooks force the slow path on the root.
- backward: wraps `torch.autograd.backward` (which `Tensor.backward` calls) and `autograd.grad`.
- optimizer: the global optimizer step pre/post hooks; a step ends after the last optimizer of
  an iteration has stepped.
- h2d (only where CUDA exists): `Tensor.to`, `Tensor.cuda`, `Tensor.copy_` from a CPU tensor to a
  CUDA one.

No global full-backward hooks: they cost milliseconds a step and break `ReLU(inplace=True)`.
`uninstall()` restores everything, so start/stop can alternate in one process.
"""

from __future__ import annotations

import functools
import threading
import weakref
from time import perf_counter_ns
from typing import Any

from .recorder import BACKWARD, DATA, FORWARD, OPTIMIZER, StepRecorder

DISCOVERY_STEPS = 3  # steps during which new root modules are looked for
DISCOVERY_CALLS = 1000  # ... or root forward calls, whichever comes first


def _timed(rec: StepRecorder, phase: int, orig: Any) -> Any:
    """`orig` wrapped so that its time on the training thread counts as `phase`.

    The hottest code torchtop has: a thread check inline, no extra call layers. The recorder
    guards itself; the try blocks here are the second line (free in CPython 3.11 until they
    catch), so that nothing can raise into the user's code.
    """
    get_ident = threading.get_ident

    @functools.wraps(orig)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if rec.active and get_ident() == rec.thread_id:
            try:
                rec.enter(phase)
            except Exception:
                rec._fail()
            try:
                return orig(*args, **kwargs)
            finally:
                try:
                    rec.exit(phase)
                except Exception:
                    rec._fail()
        return orig(*args, **kwargs)

    return wrapper


def _may_be_cuda(args: tuple, kwargs: dict) -> bool:
    """Whether `Tensor.to(*args, **kwargs)` may target a GPU: a device, a device string or index, or
    another tensor (whatever its device). A dtype alone never does."""
    target = kwargs.get("device", args[0] if args else None)
    if target is None:
        return "other" in kwargs
    if isinstance(target, str):
        return target.startswith("cuda")
    if isinstance(target, int):
        return True  # a device index
    if hasattr(target, "is_cuda"):
        return bool(target.is_cuda)  # another tensor
    return getattr(target, "type", None) == "cuda"  # a torch.device (a dtype has no .type)


def _compiling(torch: Any) -> Any:
    fn = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return fn if fn is not None else (lambda: False)


class AutoHooks:
    """Installs and removes every automatic hook for one recorder."""

    def __init__(self, recorder: StepRecorder, torch: Any, h2d: bool) -> None:
        self.rec = recorder
        self.torch = torch
        self.want_h2d = h2d
        self._undo: list[Any] = []
        self._roots: dict[int, Any] = {}  # id(module) -> weakref
        self._not_roots: set[int] = set()  # parameterless modules called on their own
        self._patched: set[type] = set()  # classes whose forward is wrapped
        self._once: list[Any] = []  # one-shot hooks timing a root's discovery call
        self._depth = 0
        self._root_calls = 0
        self._global_handle: Any = None
        self._seen_opts: set[int] = set()
        self._stepped: set[int] = set()
        self._opt_ran = False
        self._grad_enabled = torch.is_grad_enabled
        self._compiling = _compiling(torch)

    # -- install / uninstall -------------------------------------------------------------------
    def install(self) -> None:
        self._patch_dataloader()
        self._hook_forward()
        self._patch_backward()
        self._hook_optimizer()
        self._patch_grad_scaler()
        if self.want_h2d:
            self._patch_h2d()

    def uninstall(self) -> None:
        while self._undo:
            undo = self._undo.pop()
            try:
                undo()
            except Exception:
                pass
        self._roots.clear()
        self._not_roots.clear()
        self._patched.clear()
        self._once.clear()
        self._depth = 0

    def _setattr(self, owner: Any, name: str, value: Any) -> None:
        if name in owner.__dict__:
            original = owner.__dict__[name]
            self._undo.append(lambda: setattr(owner, name, original))
        else:  # inherited: removing ours uncovers it again
            self._undo.append(lambda: delattr(owner, name))
        setattr(owner, name, value)

    def _handle(self, handle: Any) -> Any:
        self._undo.append(handle.remove)
        return handle

    def root_modules(self) -> list[Any]:
        return [m for m in (r() for r in self._roots.values()) if m is not None]

    # -- data ----------------------------------------------------------------------------------
    def _patch_dataloader(self) -> None:
        from torch.utils.data import dataloader

        cls = dataloader._BaseDataLoaderIter
        orig = cls.__next__
        rec = self.rec

        __next__ = _timed(rec, DATA, orig)
        self._setattr(cls, "__next__", __next__)
        self._patch_queue_get()

    def _patch_queue_get(self) -> None:
        """A thread-prefetching loader hands batches over a queue.Queue: the training thread's
        wait in `get()` is its data wait (the loader thread's own work is not counted)."""
        import queue

        orig = queue.Queue.get
        rec = self.rec

        get = _timed(rec, DATA, orig)
        self._setattr(queue.Queue, "get", get)

    # -- forward -------------------------------------------------------------------------------
    def _hook_forward(self) -> None:
        import warnings

        from torch.nn.modules import module as module_mod

        # torch warns that global hooks fire twice around an OptimizedModule: ours count depth
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")

        self._global_handle = self._handle(module_mod.register_module_forward_pre_hook(self._discover))

    def _discover(self, module: Any, args: Any) -> None:
        if self._compiling():  # traced by dynamo: do nothing it would break a graph on
            return
        rec = self.rec
        try:
            # the limit first: a loop whose roots are all known calls no new root, and the global
            # hook must still go (while it exists every module call takes nn.Module's slow path)
            if rec.index >= DISCOVERY_STEPS or self._root_calls >= DISCOVERY_CALLS:
                self._end_discovery()
                return
            key = id(module)
            if not rec.on_thread() or self._depth > 0 or key in self._roots or key in self._not_roots:
                return
            if next(module.parameters(), None) is None:
                self._not_roots.add(key)  # a loss function or activation called on its own: not a model
                return
            self._roots[key] = weakref.ref(module)
            self._adopt(module)
            # this call's forward was chosen before this hook ran: time it with a one-shot hook
            self._root_enter(module)
            self._once.append(module.register_forward_hook(self._once_post, always_call=True))
        except Exception:
            rec._fail()

    def _once_post(self, module: Any, args: Any, output: Any) -> None:
        try:
            self._once.pop().remove()
        except Exception:
            pass
        self._root_leave(module)

    def _adopt(self, module: Any) -> None:
        """Time a root's forward from now on as cheaply as possible.

        Wrapping the class's `forward` keeps nn.Module's fast call path (an instance hook would
        force the slow one: microseconds a call), and unlike an instance attribute it survives
        deepcopy (EMA models) and pickling. A module with a forward of its own in its __dict__
        (torch.compile's OptimizedModule) gets instance hooks instead.
        """
        cls = type(module)
        if "forward" in module.__dict__ or not callable(getattr(cls, "forward", None)):
            self._handle(module.register_forward_pre_hook(self._hook_pre))
            self._handle(module.register_forward_hook(self._hook_post, always_call=True))
            return
        if cls in self._patched:
            return
        self._patched.add(cls)
        orig = cls.forward
        hooks, rec, roots, compiling = self, self.rec, self._roots, self._compiling

        @functools.wraps(orig)
        def forward(this: Any, *args: Any, **kwargs: Any) -> Any:
            if compiling() or id(this) not in roots or not rec.on_thread():
                return orig(this, *args, **kwargs)
            hooks._root_enter(this)
            try:
                return orig(this, *args, **kwargs)
            finally:
                hooks._root_leave(this)

        self._setattr(cls, "forward", forward)

    def _end_discovery(self) -> None:
        if self._global_handle is not None:
            self._global_handle.remove()
            self._global_handle = None

    def _hook_pre(self, module: Any, args: Any) -> None:
        if not self._compiling() and self.rec.on_thread():
            self._root_enter(module)

    def _hook_post(self, module: Any, args: Any, output: Any) -> None:
        if not self._compiling() and self.rec.on_thread():
            self._root_leave(module)

    def _root_enter(self, module: Any) -> None:
        """On the training thread: the outermost root forward opens the FORWARD phase."""
        try:
            if self._depth == 0:
                self._root_calls += 1
                self.rec.forward_start(id(module), self._grad_enabled())
            self._depth += 1
        except Exception:
            self.rec._fail()

    def _root_leave(self, module: Any) -> None:
        try:
            if self._depth > 0:
                self._depth -= 1
                if self._depth == 0:
                    self.rec.exit(FORWARD)
        except Exception:
            self.rec._fail()

    # -- backward ------------------------------------------------------------------------------
    def _patch_backward(self) -> None:
        autograd = self.torch.autograd
        rec = self.rec
        for name in ("backward", "grad"):
            orig = getattr(autograd, name)

            self._setattr(autograd, name, _timed(rec, BACKWARD, orig))

    # -- optimizer -----------------------------------------------------------------------------
    def _hook_optimizer(self) -> None:
        from torch.optim import optimizer as optim_mod

        self._handle(optim_mod.register_optimizer_step_pre_hook(self._opt_pre))
        self._handle(optim_mod.register_optimizer_step_post_hook(self._opt_post))

    def _opt_pre(self, opt: Any, args: Any, kwargs: Any) -> None:
        rec = self.rec
        if self._compiling() or not rec.on_thread():
            return
        try:
            oid = id(opt)
            if oid in self._stepped and not rec.explicit:
                # it stepped twice in one step: the cycle is only what stepped since the last cut
                self._seen_opts = set(self._stepped)
                self._stepped.clear()
                rec.boundary()
            self._seen_opts.add(oid)
        except Exception:
            rec._fail()
        try:
            rec.enter(OPTIMIZER)
        except Exception:
            rec._fail()

    def _opt_post(self, opt: Any, args: Any, kwargs: Any) -> None:
        rec = self.rec
        if self._compiling() or not rec.on_thread():
            return
        try:
            rec.exit(OPTIMIZER)
            self._opt_ran = True
            self._cycle_done(opt)
        except Exception:
            rec._fail()

    def _cycle_done(self, opt: Any) -> None:
        """`opt` stepped (or was skipped): end the step once every optimizer of the cycle has."""
        if self.rec.explicit:
            return
        self._seen_opts.add(id(opt))
        self._stepped.add(id(opt))
        if self._stepped >= self._seen_opts:
            self._stepped.clear()
            self.rec.boundary()

    def _patch_grad_scaler(self) -> None:
        """A GradScaler step skipped for inf/NaN gradients never calls optimizer.step(): count
        it as that optimizer's step (marked skipped) so the step still ends there."""
        scaler_cls = getattr(getattr(self.torch, "amp", None), "GradScaler", None)
        if scaler_cls is None or not hasattr(scaler_cls, "step"):
            return
        orig = scaler_cls.step
        rec = self.rec
        hooks = self

        @functools.wraps(orig)
        def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            before = rec.index
            hooks._opt_ran = False
            out = orig(scaler, optimizer, *args, **kwargs)
            try:
                if not hooks._opt_ran and rec.on_thread() and rec.index == before:
                    rec.note_skipped()
                    hooks._cycle_done(optimizer)
            except Exception:
                rec._fail()
            return out

        self._setattr(scaler_cls, "step", step)

    # -- host to device ------------------------------------------------------------------------
    def _patch_h2d(self) -> None:
        torch = self.torch
        rec = self.rec
        compiling = _compiling(torch)
        Tensor = torch.Tensor

        def begin() -> Any:
            try:
                return rec._record() if rec.h2d_events() else None
            except Exception:
                rec._fail()
                return None

        def settle(t: int, ev0: Any, was_h2d: bool, src: Any) -> None:
            dt = perf_counter_ns() - t
            try:
                if was_h2d:
                    rec.add_h2d(dt, src.nbytes, src.is_pinned())
                    if ev0 is not None:
                        rec.add_h2d_events(ev0, rec._record())
                elif ev0 is not None:
                    rec.pool.give(ev0)
            except Exception:
                rec._fail()

        orig_to, orig_cuda, orig_copy = Tensor.to, Tensor.cuda, Tensor.copy_

        @functools.wraps(orig_to)
        def to(self: Any, *args: Any, **kwargs: Any) -> Any:
            if compiling() or self.is_cuda or not rec.on_thread():
                return orig_to(self, *args, **kwargs)
            # a CUDA event only where the target may be a GPU: `.to(dtype)` is most calls
            ev0 = begin() if _may_be_cuda(args, kwargs) else None
            t = perf_counter_ns()
            out = orig_to(self, *args, **kwargs)
            settle(t, ev0, getattr(out, "is_cuda", False), self)
            return out

        @functools.wraps(orig_cuda)
        def cuda(self: Any, *args: Any, **kwargs: Any) -> Any:
            if compiling() or self.is_cuda or not rec.on_thread():
                return orig_cuda(self, *args, **kwargs)
            ev0 = begin()
            t = perf_counter_ns()
            out = orig_cuda(self, *args, **kwargs)
            settle(t, ev0, True, self)
            return out

        @functools.wraps(orig_copy)
        def copy_(self: Any, src: Any, *args: Any, **kwargs: Any) -> Any:
            if compiling() or not self.is_cuda or getattr(src, "is_cuda", True) or not rec.on_thread():
                return orig_copy(self, src, *args, **kwargs)
            ev0 = begin()
            t = perf_counter_ns()
            out = orig_copy(self, src, *args, **kwargs)
            settle(t, ev0, True, src)
            return out

        self._setattr(Tensor, "to", to)
        self._setattr(Tensor, "cuda", cuda)
        self._setattr(Tensor, "copy_", copy_)
