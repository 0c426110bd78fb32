"""One training step under `torch.utils.flop_counter.FlopCounterMode`: the model's FLOPs a step.

Armed by the agent thread (why.py) as one of the probe's step-boundary hooks (step_hooks.py:
Order.FLOP_COUNT, after a capture, which outranks it while the count is only armed): at the next
step boundary the training thread enters the counter, at the one after it leaves it and hands
the count over. That step runs slower (every op goes through a Python dispatch mode; the agent
says so on stderr) and the monitor leaves it, and the step after it (which pays for the exit),
out of its figures. Meanwhile a forward pre-hook on each root module reads the batch's shape:
samples a step (the input's batch dimension, summed over micro-batches: the first, or the
second where the model's recurrent or attention layers say batch_first=False, as time-major
RNNs and Transformers take (T, B, ...)) and, for a 2-D integer input (token ids), tokens a step.
Only the work inside modules counts (forward and backward, as FlopCounterMode attributes it to
them): a loop's preprocessing between steps (a generator's matmuls) is not the model's. Nothing
of this is left on the hot path afterwards.

FLOPs are also split by the dtype of each counted op's first input (the peak FLOP/s depends on
it), through FlopCounterMode's public `custom_mapping`: each formula of torch's registry is
passed in again wrapped to note the dtype before it counts.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any

from torchtop.agent.hooks.step_hooks import Order

if TYPE_CHECKING:
    from torchtop.agent.hooks.probe import Probe

HOOK = "flop-count"  # its step-boundary hook's name
MAX_EXIT_TRIES = 8  # boundaries to wait for our mode to be on top of the dispatch stack again


class FlopResult:
    """What one counted step found (filled on the training thread, read by the agent thread)."""

    def __init__(self) -> None:
        self.flops = 0
        self.by_dtype: dict[str, int] = defaultdict(int)
        self.samples = 0
        self.tokens = 0
        self.input_shape: list[int] = []
        self.input_dtype = ""
        self.t0 = 0
        self.t1 = 0
        self.error = ""


CONV_FP32 = "float32:conv"  # float32 convolutions on CUDA: cuDNN's TF32 switch decides their peak


def _dtype_tap(formula: Any, tally: dict[str, int], conv: bool = False) -> Any:
    """`formula` (a registry entry: it takes tensors and turns them into shapes) noting the
    dtype of its first tensor argument (float32 convolutions on CUDA apart: CONV_FP32)."""

    def counted(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
        n = formula(*args, out_val=out_val, **kwargs)
        first = next((a for a in args if hasattr(a, "dtype")), None)
        key = str(first.dtype).replace("torch.", "") if first is not None else "?"
        if conv and key == "float32" and getattr(first, "is_cuda", False):
            key = CONV_FP32
        tally[key] += n
        return n

    counted._get_raw = True  # type: ignore[attr-defined]  # FlopCounterMode passes it tensors as they are
    return counted


def first_tensor(torch: Any, args: Any, kwargs: Any) -> Any:
    for a in (*args, *(kwargs or {}).values()):
        if isinstance(a, torch.Tensor):
            return a
    return None


def batch_dim(module: Any) -> int:
    """The batch dimension of a module's input: 1 where its first layer that says (an RNN, a
    Transformer, an attention) has batch_first=False (time-major input, (T, B, ...)), else 0."""
    try:
        for m in module.modules():
            first = getattr(m, "batch_first", None)
            if isinstance(first, bool):
                return 0 if first else 1
    except Exception:  # broad: a module that cannot say: batch dimension unknown
        pass
    return 0


def flops_inside_modules(counter: Any) -> int:
    """FLOPs FlopCounterMode attributed to top-level modules (their forward and backward); 0 when
    it tracked none (a model of plain functions: then every op counts)."""
    try:
        counts = counter.get_flop_counts()
    except Exception:  # broad: another torch's counter: no per-module split
        return 0
    return int(sum(sum(ops.values()) for name, ops in counts.items() if name != "Global" and "." not in name))


class FlopStep:
    """A step-boundary hook for two boundaries: enter the counter, then leave it and call `done`."""

    def __init__(
        self, torch: Any, probe: Probe, roots: Callable[[], list[Any]], done: Callable[[FlopResult], None]
    ) -> None:
        # imported here, on the agent thread, not on the training thread at the boundary
        from torch.utils.flop_counter import FlopCounterMode, flop_registry

        self.torch = torch
        self.probe = probe
        self.roots = roots
        self.done = done
        self.result = FlopResult()
        try:
            mapping = {
                k: _dtype_tap(v, self.result.by_dtype, "convolution" in str(k))
                for k, v in flop_registry.items()
            }
            self.counter: Any = FlopCounterMode(display=False, custom_mapping=mapping)
        except Exception:  # broad: another torch's registry: FLOPs without the dtype split
            self.counter = FlopCounterMode(display=False)
        self.entered = False
        self.finished = False
        self.tid = 0  # the thread that entered the counter: only it can leave it
        self._handles: list[Any] = []
        self._batch_dims: dict[int, int] = {}  # id(root) -> the batch dimension of its input
        self._tries = 0

    # -- agent thread -----------------------------------------------------------------------------
    def arm(self) -> bool:
        """Register as the probe's FLOP_COUNT hook (False: the rule says wait, step_hooks.RULE)."""
        return self.probe.hooks.register(HOOK, self, Order.FLOP_COUNT)

    def armed(self) -> bool:
        """Still registered (a capture displaces the count while it is only armed)."""
        return self.probe.hooks.holds(HOOK, self)

    def disarm(self) -> None:
        self.probe.hooks.unregister(HOOK, self)

    # -- training thread -----------------------------------------------------------------------------
    def __call__(self) -> None:
        """At a step boundary, on the training thread (Probe.housekeep)."""
        if not self.entered:
            if self.probe.hooks.open(HOOK, self):  # else displaced meanwhile: never entered
                self._enter()
        else:
            self._exit()

    def _enter(self) -> None:
        r = self.result
        try:
            for root in self.roots():
                self._batch_dims[id(root)] = batch_dim(root)
                self._handles.append(root.register_forward_pre_hook(self._batch, with_kwargs=True))
            r.t0 = perf_counter_ns()
            self.counter.__enter__()
            self.entered = True
            self.tid = threading.get_ident()
        except Exception as exc:  # broad: an optional count: any failure disarms it
            self._remove_hooks()
            self.disarm()
            r.error = f"{type(exc).__name__}: {exc}"[:200]
            self.finished = True
            self.done(r)

    def finish_here(self) -> None:
        """The agent stops mid-count: leave the counter now if this is the thread that entered it
        (the dispatch mode is that thread's); elsewhere it cannot be left."""
        if self.entered and not self.finished and threading.get_ident() == self.tid:
            self._tries = MAX_EXIT_TRIES
            self._exit()

    def _exit(self) -> None:
        r = self.result
        mode = getattr(self.counter, "mode", None)
        try:
            from torch.utils._python_dispatch import _get_current_dispatch_mode

            if mode is not None and _get_current_dispatch_mode() is not mode:
                self._tries += 1  # a mode of the user's is on top: popping ours would pop theirs
                if self._tries < MAX_EXIT_TRIES:
                    return
                raise RuntimeError("another dispatch mode stayed on top of the FLOP counter")
            self.counter.__exit__(None, None, None)
            r.flops = int(self.counter.get_total_flops())
            inside = flops_inside_modules(self.counter)
            if 0 < inside < r.flops:  # ops outside every module: the loop's own, not the model's
                for k in r.by_dtype:  # the dtype split scaled alike (it is counted per op, not per module)
                    r.by_dtype[k] = r.by_dtype[k] * inside // r.flops
                r.flops = inside
        except Exception as exc:  # broad: any failure is the count's error, never raised into training
            r.error = f"{type(exc).__name__}: {exc}"[:200]
        self._remove_hooks()
        self.disarm()
        self.finished = True
        r.t1 = perf_counter_ns()
        self.done(r)

    def _remove_hooks(self) -> None:
        for h in self._handles:
            try:
                h.remove()
            except Exception:  # broad: best-effort hook removal
                pass
        self._handles.clear()

    def _batch(self, module: Any, args: Any, kwargs: Any) -> None:
        """A root's forward pre-hook during the counted step: the batch's shape."""
        torch = self.torch
        if not torch.is_grad_enabled():
            return  # an evaluation forward inside the step
        x = first_tensor(torch, args, kwargs)
        if x is None or x.dim() == 0:
            return
        r = self.result
        dim = self._batch_dims.get(id(module), 0) if x.dim() > 1 else 0
        r.samples += int(x.shape[dim])
        if x.dim() == 2 and not x.is_floating_point() and not x.is_complex():
            r.tokens += int(x.shape[0] * x.shape[1])
        if not r.input_shape:
            r.input_shape = [int(n) for n in x.shape]
            r.input_dtype = str(x.dtype).replace("torch.", "")
