"""Zero-code instrumentation: the patches and hooks that feed the StepRecorder.

- DataLoader wait: `_BaseDataLoaderIter.__next__` (shared by single- and multi-process iterators),
  counted only on the training thread.
- forward: one global forward pre-hook finds the root modules (modules called while no root
  forward is open) during the first steps, then per-instance hooks on those roots only; the
  global hook removes itself. Global hooks on every module would cost ~1.7 us per module call.
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
import weakref
from time import perf_counter_ns
from typing import Any

from .recorder import BACKWARD, DATA, FORWARD, OPTIMIZER, StepRecorder

DISCOVERY_STEPS = 3  # steps during which new root modules are looked for
DISCOVERY_CALLS = 1000  # ... or root forward calls, whichever comes first


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
        self._depth = 0
        self._root_calls = 0
        self._global_handle: Any = None
        self._seen_opts: set[int] = set()
        self._stepped: set[int] = set()

    # -- install / uninstall -------------------------------------------------------------------
    def install(self) -> None:
        self._patch_dataloader()
        self._hook_forward()
        self._patch_backward()
        self._hook_optimizer()
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

        @functools.wraps(orig)
        def __next__(it: Any) -> Any:
            if not rec.on_thread():
                return orig(it)
            rec.enter(DATA)
            try:
                return orig(it)
            finally:
                rec.exit(DATA)

        self._setattr(cls, "__next__", __next__)

    # -- forward -------------------------------------------------------------------------------
    def _hook_forward(self) -> None:
        from torch.nn.modules import module as module_mod

        self._global_handle = self._handle(module_mod.register_module_forward_pre_hook(self._discover))

    def _discover(self, module: Any, args: Any) -> None:
        try:
            rec = self.rec
            if not rec.on_thread() or self._depth > 0 or id(module) in self._roots:
                return
            if rec.index >= DISCOVERY_STEPS or self._root_calls >= DISCOVERY_CALLS:
                self._end_discovery()
                return
            self._roots[id(module)] = weakref.ref(module)
            self._handle(module.register_forward_pre_hook(self._root_pre))
            self._handle(module.register_forward_hook(self._root_post, always_call=True))
            self._root_pre(module, args)  # this call's instance pre-hooks were already chosen
        except Exception:
            rec._fail()

    def _end_discovery(self) -> None:
        if self._global_handle is not None:
            self._global_handle.remove()
            self._global_handle = None

    def _root_pre(self, module: Any, args: Any) -> None:
        rec = self.rec
        if not rec.on_thread():
            return
        if self._depth == 0:
            self._root_calls += 1
            rec.enter(FORWARD)
        self._depth += 1

    def _root_post(self, module: Any, args: Any, output: Any) -> None:
        rec = self.rec
        if not rec.on_thread() or self._depth == 0:
            return
        self._depth -= 1
        if self._depth == 0:
            rec.exit(FORWARD)

    # -- backward ------------------------------------------------------------------------------
    def _patch_backward(self) -> None:
        autograd = self.torch.autograd
        rec = self.rec
        for name in ("backward", "grad"):
            orig = getattr(autograd, name)

            def make(orig: Any) -> Any:
                @functools.wraps(orig)
                def wrapper(*args: Any, **kwargs: Any) -> Any:
                    if not rec.on_thread():
                        return orig(*args, **kwargs)
                    rec.enter(BACKWARD)
                    try:
                        return orig(*args, **kwargs)
                    finally:
                        rec.exit(BACKWARD)

                return wrapper

            self._setattr(autograd, name, make(orig))

    # -- optimizer -----------------------------------------------------------------------------
    def _hook_optimizer(self) -> None:
        from torch.optim import optimizer as optim_mod

        self._handle(optim_mod.register_optimizer_step_pre_hook(self._opt_pre))
        self._handle(optim_mod.register_optimizer_step_post_hook(self._opt_post))

    def _opt_pre(self, opt: Any, args: Any, kwargs: Any) -> None:
        rec = self.rec
        if not rec.on_thread():
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
        rec.enter(OPTIMIZER)

    def _opt_post(self, opt: Any, args: Any, kwargs: Any) -> None:
        rec = self.rec
        if not rec.on_thread():
            return
        rec.exit(OPTIMIZER)
        if rec.explicit:
            return
        try:
            self._stepped.add(id(opt))
            if self._stepped >= self._seen_opts:  # every optimizer of the cycle has stepped
                self._stepped.clear()
                rec.boundary()
        except Exception:
            rec._fail()

    # -- host to device ------------------------------------------------------------------------
    def _patch_h2d(self) -> None:
        torch = self.torch
        rec = self.rec
        compiling = _compiling(torch)
        Tensor = torch.Tensor

        def timed(call: Any) -> Any:
            sample = rec.h2d_events()
            ev0 = rec._record() if sample else None
            t = perf_counter_ns()
            out = call()
            dt = perf_counter_ns() - t
            return out, dt, ev0

        def settle(out: Any, dt: int, ev0: Any, was_h2d: bool) -> None:
            try:
                if was_h2d:
                    rec.add_h2d(dt)
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
            out, dt, ev0 = timed(lambda: orig_to(self, *args, **kwargs))
            settle(out, dt, ev0, getattr(out, "is_cuda", False))
            return out

        @functools.wraps(orig_cuda)
        def cuda(self: Any, *args: Any, **kwargs: Any) -> Any:
            if compiling() or self.is_cuda or not rec.on_thread():
                return orig_cuda(self, *args, **kwargs)
            out, dt, ev0 = timed(lambda: orig_cuda(self, *args, **kwargs))
            settle(out, dt, ev0, True)
            return out

        @functools.wraps(orig_copy)
        def copy_(self: Any, src: Any, *args: Any, **kwargs: Any) -> Any:
            if compiling() or not self.is_cuda or getattr(src, "is_cuda", True) or not rec.on_thread():
                return orig_copy(self, src, *args, **kwargs)
            out, dt, ev0 = timed(lambda: orig_copy(self, src, *args, **kwargs))
            settle(out, dt, ev0, True)
            return out

        self._setattr(Tensor, "to", to)
        self._setattr(Tensor, "cuda", cuda)
        self._setattr(Tensor, "copy_", copy_)
