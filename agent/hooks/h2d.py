"""Host-to-device copies: `Tensor.to`, `Tensor.cuda` and `Tensor.copy_` from a CPU tensor to a
CUDA one, timed on the training thread (installed only where CUDA exists).

A copy's host time moves from the open phase to h2d; its bytes are counted as pinned or
pageable, and on an event step a pair of CUDA events brackets it on the GPU.
"""

from __future__ import annotations

import functools
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any

from torchtop.agent.hooks.probe import Probe, current
from torchtop.agent.hooks.timed import compiling_check
from torchtop.agent.hooks.wrap import note_phase
from torchtop.contract.logcodes import H2D

if TYPE_CHECKING:
    from types import ModuleType

    from torch import Tensor
    from torch.cuda import Event

    from torchtop.agent.hooks.wrap import SetAttr


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


def patch_h2d(probe: Probe, torch: ModuleType, setattr_: SetAttr) -> None:
    """Wrap the three copy methods of `torch.Tensor` through `setattr_` (which keeps the undo)."""
    compiling = compiling_check(torch)
    tensor_cls = torch.Tensor

    def begin() -> Event | None:
        try:
            return probe.record() if probe.event_step else None
        except Exception:  # broad: never into the training loop (probe.fail counts it)
            probe.fail()
            return None

    def settle(t: int, ev0: Event | None, was_h2d: bool, src: Tensor) -> None:
        dt = perf_counter_ns() - t
        try:
            if was_h2d:
                probe.h2d(
                    t, dt, src.nbytes, src.is_pinned(), ev0, probe.record() if ev0 is not None else None
                )
            elif ev0 is not None and probe.pool is not None:
                probe.pool.give(ev0)
        except Exception:  # broad: never into the training loop (probe.fail counts it)
            probe.fail()

    orig_to, orig_cuda, orig_copy = tensor_cls.to, tensor_cls.cuda, tensor_cls.copy_

    @functools.wraps(orig_to)
    def to(self: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        # is_cuda first: most calls are a model's `.to(dtype)` on GPU tensors, and dynamo
        # traces it; then compiling(): dynamo traces a `.to()` inside a compiled forward and
        # cannot trace the context-variable read (a graph break, an error under fullgraph=True)
        if self.is_cuda or probe.untimed or compiling() or (current() is not probe and probe.adopt() is None):
            return orig_to(self, *args, **kwargs)
        # a CUDA event only where the target may be a GPU: `.to(dtype)` is most calls
        ev0 = begin() if _may_be_cuda(args, kwargs) else None
        t = perf_counter_ns()
        out = orig_to(self, *args, **kwargs)
        settle(t, ev0, getattr(out, "is_cuda", False), self)
        return out

    @functools.wraps(orig_cuda)
    def cuda(self: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if self.is_cuda or probe.untimed or compiling() or (current() is not probe and probe.adopt() is None):
            return orig_cuda(self, *args, **kwargs)
        ev0 = begin()
        t = perf_counter_ns()
        out = orig_cuda(self, *args, **kwargs)
        settle(t, ev0, True, self)
        return out

    @functools.wraps(orig_copy)
    def copy_(self: Tensor, src: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if (
            not self.is_cuda
            or probe.untimed
            or compiling()
            or getattr(src, "is_cuda", True)
            or (current() is not probe and probe.adopt() is None)
        ):
            return orig_copy(self, src, *args, **kwargs)
        ev0 = begin()
        t = perf_counter_ns()
        out = orig_copy(self, src, *args, **kwargs)
        settle(t, ev0, True, src)
        return out

    setattr_(tensor_cls, "to", note_phase(to, H2D))
    setattr_(tensor_cls, "cuda", note_phase(cuda, H2D))
    setattr_(tensor_cls, "copy_", note_phase(copy_, H2D))
