"""Zero-code instrumentation: the patches and hooks that feed the probe on the training thread.

data (`DataLoader` iterators, `queue.Queue.get`), forward (root modules found by a global
pre-hook during the first steps, then their class `forward` wrapped), backward
(`torch.autograd.backward`/`grad`; in a distributed run a timed backward also logs where its
compute ends), torch.distributed's blocking collectives (the `comm` phase: collectives.py), the
optimizer (optimizer.py), host-to-device copies (h2d.py), saves (the `checkpoint` phase: checkpoint.py)
and `model.compile()` in place (compiled.py). Each hook only logs into the `Probe`; step ends are
decided at the optimizer, because a capture must start there. Why each hook is where it is:
docs/architecture.md, "The step model". `uninstall()` restores everything.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torchtop.agent.hooks.optimizer import OptimizerSteps
from torchtop.agent.hooks.phase_sampling import UNTIMED
from torchtop.agent.hooks.probe import Probe
from torchtop.agent.hooks.timed import compiling_check, dynamo_check, timed, timed_forward
from torchtop.agent.warn import ignore_warning
from torchtop.contract.logcodes import BACKWARD, DATA, FORWARD, FORWARD_START, GRAD, MAX_SLOT, SKIPPED

if TYPE_CHECKING:
    from types import ModuleType

    from torch import nn
    from torch.amp import GradScaler
    from torch.optim import Optimizer
    from torch.utils.hooks import RemovableHandle

    from torchtop.agent.hooks.checkpoint import Saves
    from torchtop.agent.hooks.waits import Waits

DISCOVERY_STEPS = 3  # steps during which new root modules are looked for
DISCOVERY_CALLS = 1000  # ... or root forward calls, whichever comes first


def _callers(frame: Any, depth: int = 32) -> tuple[Any, ...]:
    """The code objects of `frame` and the frames outward of it (at most `depth`)."""
    out = []
    while frame is not None and len(out) < depth:
        out.append(frame.f_code)
        frame = frame.f_back
    return tuple(out)


class AutoHooks:
    """Installs and removes every automatic hook for one probe."""

    def __init__(self, probe: Probe, torch: ModuleType, h2d: bool) -> None:
        self.probe = probe
        self.torch = torch
        self.want_h2d = h2d
        self._undo: list[Callable[[], object]] = []
        from torchtop.agent.hooks.work import bind

        bind(torch.Tensor)
        self._roots: dict[int, weakref.ref[nn.Module]] = {}
        self._slots: dict[int, int] = {}  # id(root module) -> its slot in the log's codes
        self._not_roots: set[int] = set()  # parameterless modules called on their own
        # class -> its wrapper's roots: [weakref to the first, its code], {id: code} of others
        self._patched: dict[type, tuple[list[Any], dict[int, int]]] = {}
        self._once: list[RemovableHandle] = []  # one-shot hooks timing a root's discovery call
        self._root_calls = 0
        self.discovery_hook: RemovableHandle | None = None
        self.optimizers = OptimizerSteps(probe)
        self._grad_enabled = torch.is_grad_enabled
        self.scan_compiled: Callable[[], int] | None = (
            None  # set by compiled.py: finds modules compiled before start()
        )
        self._scanned = False
        self.waits: Waits | None = None  # collective waits (waits.py), set at install
        self.saves: Saves | None = None  # saves as the checkpoint phase (checkpoint.py), set at install
        self.compiling = compiling_check(torch)
        self._dynamo = dynamo_check(torch)

    # -- install / uninstall -------------------------------------------------------------------
    def install(self) -> None:
        self._patch_dataloader()
        self._hook_forward()
        self._patch_backward()
        self.optimizers.install(self._setattr, self._undo.append)
        self._patch_grad_scaler()
        from torchtop.agent.hooks.compiled import patch_module_compile

        patch_module_compile(self, self.torch, self._setattr, self._undo.append)
        if self.want_h2d:
            from torchtop.agent.hooks.h2d import patch_h2d

            patch_h2d(self.probe, self.torch, self._setattr)
        from torchtop.agent.hooks.checkpoint import Saves

        self.saves = Saves(self.probe, self._setattr)
        self.saves.install(self.torch)

    def uninstall(self) -> None:
        while self._undo:
            undo = self._undo.pop()
            try:
                undo()
            except Exception:  # broad: best-effort undo; the other undos still run
                pass
        self._roots.clear()
        self._slots.clear()
        self._not_roots.clear()
        self._patched.clear()
        self._once.clear()
        self.scan_compiled = None
        self.waits = None
        self.saves = None
        self.probe.depth = 0
        self.optimizers.uninstall()

    def agent_tick(self) -> None:
        """Agent thread, each tick: if the first steps went by and no root forward was seen,
        look for modules compiled in place before start() (no hook of ours runs in their calls)
        and time them from then on. Only then: the walk over the garbage collector's objects
        holds the GIL for tens of milliseconds."""
        if self.waits is not None:
            self.waits.tick()
        if self.saves is not None:
            self.saves.tick()
        if self._scanned or self.probe.steps < DISCOVERY_STEPS:
            return
        self._scanned = True
        if not self._roots and self.scan_compiled is not None and "torch._dynamo" in sys.modules:
            self.scan_compiled()

    def _setattr(self, owner: object, name: str, value: object) -> None:
        if name in owner.__dict__:
            original = owner.__dict__[name]
            self._undo.append(lambda: setattr(owner, name, original))
        else:  # inherited: removing ours uncovers it again
            self._undo.append(lambda: delattr(owner, name))
        setattr(owner, name, value)

    def _handle(self, handle: RemovableHandle) -> RemovableHandle:
        self._undo.append(handle.remove)
        return handle

    def seen_model(self) -> bool:
        """A root module (one with parameters) has run its forward in this process."""
        return bool(self._roots)

    def root_modules(self) -> list[nn.Module]:
        return [m for m in (r() for r in self._roots.values()) if m is not None]

    # -- data ----------------------------------------------------------------------------------
    def _patch_dataloader(self) -> None:
        from torch.utils.data import dataloader

        cls = dataloader._BaseDataLoaderIter
        # no CUDA events around the data wait: its device time means nothing, and two records are
        # a fifth of an event step's cost
        self._setattr(cls, "__next__", timed(self.probe, DATA, cls.__next__, events=False))
        self._patch_queue_get()

    def _patch_queue_get(self) -> None:
        """A thread-prefetching loader hands batches over a queue.Queue: the training thread's
        wait in `get()` is its data wait (the loader thread's own work is not counted)."""
        import queue

        self._setattr(queue.Queue, "get", timed(self.probe, DATA, queue.Queue.get, events=False))

    # -- forward -------------------------------------------------------------------------------
    def _hook_forward(self) -> None:
        from torch.nn.modules import module as module_mod

        # torch warns that global hooks fire twice around an OptimizedModule: ours count depth.
        # Only while installed: uninstall removes exactly this filter.
        self._undo.append(
            ignore_warning(message=r"Using `torch.compile\(module\)` when there are global hooks")
        )

        self.discovery_hook = self._handle(module_mod.register_module_forward_pre_hook(self._discover))

    def _discover(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self.compiling():  # traced by dynamo: do nothing it would break a graph on
            return
        probe = self.probe
        try:
            # the limit first: a loop whose roots are all known calls no new root, and the global
            # hook must still go (while it exists every module call takes nn.Module's slow path)
            if probe.steps >= DISCOVERY_STEPS or self._root_calls >= DISCOVERY_CALLS or not probe.active:
                self._end_discovery()
                return
            key = id(module)
            if key in self._roots:
                self._root_calls += 1
                return
            if not probe.on_thread() or probe.depth > 0 or key in self._not_roots:
                return
            if next(module.parameters(), None) is None:
                self._not_roots.add(key)  # a loss function or activation called on its own: not a model
                return
            self.add_root(module)
            if not probe.callers:  # once: the frames that call the model (the training loop)
                probe.callers = _callers(sys._getframe(1))
            self._adopt(module)
            # this call's forward was chosen before this hook ran: time it with a one-shot hook
            self.root_enter(module)
            self._once.append(module.register_forward_hook(self._once_post, always_call=True))
        except Exception:  # broad: never into the training loop (probe.fail counts it)
            probe.fail()

    def add_root(self, module: nn.Module) -> None:
        """Count `module` as a root: its forwards, outside any other root's, are the forward phase."""
        key = id(module)
        if key not in self._roots:
            self._roots[key] = weakref.ref(module)
            self._slots[key] = 1 + (len(self._slots) % MAX_SLOT)  # slot 0 is phase("forward")

    def _once_post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        try:
            self._once.pop().remove()
        except Exception:  # broad: best-effort removal of a one-shot hook
            pass
        self.root_leave(module)

    def _adopt(self, module: nn.Module) -> None:
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
        code = FORWARD_START + 2 * self._slots[id(module)]
        if cls in self._patched:  # another root of a class already wrapped
            root, others = self._patched[cls]
            if root[0]() is None:
                root[:] = [weakref.ref(module), code]
            else:
                others[id(module)] = code
            return
        root, others = [weakref.ref(module), code], {}
        self._patched[cls] = (root, others)
        self._setattr(
            cls,
            "forward",
            timed_forward(self.probe, cls.forward, root, others, self._dynamo, self._grad_enabled),
        )

    def _end_discovery(self) -> None:
        if self.discovery_hook is not None:
            self.discovery_hook.remove()
            self.discovery_hook = None

    def end_discovery_if_due(self) -> None:
        """Remove the discovery hook once its steps are over (a module compiled in place runs it
        only inside its compiled code, where it does nothing: it never ends itself there)."""
        if self.probe.steps >= DISCOVERY_STEPS:
            self._end_discovery()

    def _hook_pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if not self.compiling() and self.probe.on_thread():
            self.root_enter(module)

    def _hook_post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not self.compiling() and self.probe.on_thread():
            self.root_leave(module)

    def root_enter(self, module: nn.Module) -> None:
        """On the training thread: the outermost root forward opens the FORWARD phase."""
        probe = self.probe
        try:
            if probe.depth == 0:
                code, grad = FORWARD_START + 2 * self._slots.get(id(module), 0), self._grad_enabled()
                if probe.untimed >= UNTIMED and not grad:  # evaluation in an untimed stretch?
                    probe.nograd_untimed(code)
                probe.forward(code + grad)
            probe.depth += 1
        except Exception:  # broad: never into the training loop (probe.fail counts it)
            probe.fail()

    def root_leave(self, module: nn.Module) -> None:
        probe = self.probe
        try:
            if probe.depth > 0:
                probe.depth -= 1
                if probe.depth == 0:
                    probe.exit(FORWARD)
        except Exception:  # broad: never into the training loop (probe.fail counts it)
            probe.fail()

    # -- backward ------------------------------------------------------------------------------
    def _patch_backward(self) -> None:
        from torchtop.agent.hooks.collectives import BackwardWait, patch_collectives, timed_backward

        autograd = self.torch.autograd
        wait = BackwardWait(self.probe, self.torch)
        task = getattr(self.torch._C, "_current_graph_task_id", None) or (lambda: -1)
        self._setattr(autograd, "backward", timed_backward(self.probe, autograd.backward, wait.arm, task))
        patch_collectives(self.probe, self.torch, self._setattr)
        from torchtop.agent.hooks.waits import Waits

        self.waits = Waits(self.probe, self.torch, self._setattr)
        self.waits.install()
        # a gradient penalty's autograd.grad is backward time, not another micro-batch
        self._setattr(autograd, "grad", timed(self.probe, BACKWARD, autograd.grad, enter=GRAD))

    def _patch_grad_scaler(self) -> None:
        """A GradScaler step skipped for inf/NaN gradients never calls optimizer.step(): count
        it as that optimizer's step (marked skipped) so the step still ends there."""
        scaler_cls = getattr(getattr(self.torch, "amp", None), "GradScaler", None)
        if scaler_cls is None or not hasattr(scaler_cls, "step"):
            return
        orig = scaler_cls.step
        probe = self.probe
        hooks = self

        @functools.wraps(orig)
        def step(scaler: GradScaler, optimizer: Optimizer, *args: Any, **kwargs: Any) -> Any:
            before = probe.steps
            probe.opt_ran = False
            out = orig(scaler, optimizer, *args, **kwargs)
            try:
                if not probe.opt_ran and probe.on_thread() and probe.steps == before:
                    probe.stamp(SKIPPED)
                    hooks.optimizers.cycle_done(optimizer)
            except Exception:  # broad: never into the training loop (probe.fail counts it)
                probe.fail()
            return out

        self._setattr(scaler_cls, "step", step)
