"""A rank's work per step: samples and tokens from the batch its root module is called with.

A job's straggler is either slower at the same work (its GPU, its host) or given more work (uneven
packing, longer sequences, a hot expert, the last pipeline stage): different fixes. The root
forward wrapper (timed.py) calls `log_work` on timed steps only, with the call's arguments: the
first tensor among them (positional first, then keyword: `input_ids`, a dict or list batch one
level down) gives samples (its first dimension) and, for token ids (B, S) or activations
(B, S, D), tokens (B x S) and the sequence length. Images (B, C, H, W) have samples only. One
entry per root forward (micro-batches add up in the replay); nothing where no tensor is seen.
"""

from __future__ import annotations

from time import perf_counter_ns
from typing import TYPE_CHECKING, Any

from torchtop.contract.logcodes import WORK

if TYPE_CHECKING:
    from torchtop.agent.hooks.probe import Probe


_tensor: type = type(None)  # torch.Tensor, set by `bind` (this module does not import torch)


def bind(tensor_type: type) -> None:
    global _tensor
    _tensor = tensor_type


def _first_tensor(values: Any) -> Any:
    is_tensor = _tensor
    for v in values:
        if isinstance(v, is_tensor):
            return v
        if isinstance(v, dict):
            v = next((x for x in v.values() if isinstance(x, is_tensor)), None)
        elif isinstance(v, (list, tuple)):
            v = next((x for x in v if isinstance(x, is_tensor)), None)
        else:
            continue
        if v is not None:
            return v
    return None


def shape_work(t: Any) -> tuple[int, int, int] | None:
    """(samples, tokens, sequence) of a batch tensor; tokens and sequence 0 where it has none."""
    shape = t.shape
    n = len(shape)
    if n == 3 or (n == 2 and not t.is_floating_point()):
        return shape[0], shape[0] * shape[1], shape[1]
    return (shape[0], 0, 0) if n else None


def log_work(probe: Probe, module: Any, *args: Any, **kwargs: Any) -> None:
    """Training thread, a timed root forward: one WORK entry (never raises: the caller catches)."""
    t = _first_tensor(args) if args else None
    if t is None and kwargs:
        t = _first_tensor(kwargs.values())
    if t is None:
        return
    shape = t.shape
    n = len(shape)
    if n == 3 or (n == 2 and not t.is_floating_point()):
        item = (WORK, shape[0], shape[0] * shape[1], shape[1])
    elif n:
        item = (WORK, shape[0], 0, 0)
    else:
        return
    a = probe._append  # a tuple: never an event (probe.put would take it for a time)
    a(perf_counter_ns())
    a(item)
