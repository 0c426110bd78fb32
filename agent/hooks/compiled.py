"""`model.compile()` in place: the module's compiled call timed as a root forward.

Dynamo traces our hooks inside a module compiled in place as no-ops (they ask `compiling()`
first), so its forward would land in `other`. `Module.compile` is wrapped so that the compiled
call (`_compiled_call_impl`) is wrapped in turn, eagerly, and timed like any root forward.
Modules compiled before `start()` are found once by the agent thread (`scan`: a walk over the
garbage collector's objects) when the first steps went by without any root forward.
"""

from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from types import ModuleType

    from torch import nn

    from torchtop.agent.hooks.auto import AutoHooks
    from torchtop.agent.hooks.wrap import Fn, SetAttr, Undo

    Wrapped = list[tuple[weakref.ref[nn.Module], Fn, Fn]]  # (module, our call, the compiled call)


def patch_module_compile(hooks: AutoHooks, torch: ModuleType, setattr_: SetAttr, undo: Undo) -> None:
    """Wrap `torch.nn.Module.compile` through `setattr_` (which keeps its undo); `undo` takes
    what restores the modules compiled meanwhile."""
    module_cls = torch.nn.Module
    orig = module_cls.compile
    wrapped: Wrapped = []

    @functools.wraps(orig)
    def compile(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        out = orig(module, *args, **kwargs)
        try:
            _time_compiled_call(hooks, module, wrapped)
        except Exception:  # broad: never into the training loop (probe.fail counts it)
            hooks.probe.fail()
        return out

    setattr_(module_cls, "compile", compile)

    def unwrap() -> None:
        for ref, ours, inner in wrapped:
            module = ref()
            if module is not None and module.__dict__.get("_compiled_call_impl") is ours:
                module._compiled_call_impl = inner
        wrapped.clear()

    undo(unwrap)

    def scan() -> int:
        """Agent thread: time the calls of modules compiled in place before start(); how many."""
        import gc

        ours = {id(call) for _, call, _ in wrapped}
        found = []
        for obj in gc.get_objects():
            # type(), not isinstance(): no __class__ property of some proxy gets to run (or raise)
            if issubclass(type(obj), module_cls):
                impl = obj.__dict__.get("_compiled_call_impl")
                if impl is not None and id(impl) not in ours:
                    found.append(obj)
        for module in found:
            _time_compiled_call(hooks, module, wrapped)
        return len(found)

    hooks.scan_compiled = scan


def _time_compiled_call(hooks: AutoHooks, module: nn.Module, wrapped: Wrapped) -> None:
    inner = module.__dict__.get("_compiled_call_impl")
    if inner is None:
        return
    hooks.add_root(module)
    probe, compiling = hooks.probe, hooks.compiling

    def call(*args: Any, **kwargs: Any) -> Any:  # no functools.wraps: dynamo's marks stay on inner
        # compiling() first: a compiled function that calls this module traces this too
        if compiling() or not probe.on_thread():
            return inner(*args, **kwargs)
        if hooks.discovery_hook is not None:
            hooks.end_discovery_if_due()
        hooks.root_enter(module)
        try:
            return inner(*args, **kwargs)
        finally:
            hooks.root_leave(module)

    module._compiled_call_impl = call
    wrapped.append((weakref.ref(module), call, inner))
