"""torchtop's phases as NVTX ranges, on request (`TORCHTOP_NVTX=1`), on the steps sampled for CUDA events.

So the timeline a user opens in Nsight Systems shows torchtop's phases (data, h2d, forward,
backward, optimizer, comm) beside the kernels. Only on event steps (1 in `event_every`), where the
probe's `put` already records a CUDA event with each time item: there it is swapped for `NvtxPut`,
which passes each item on and pushes a range for a phase's code, pops one for its exit. Off by
default: a range push/pop is a driver call (docs/benchmarks.md has its cost).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torchtop.contract.logcodes import (
    BACKWARD,
    COMM_READY,
    EXIT,
    FORWARD_START,
    GRAD,
    MASK,
    SAVE,
    STEP_END,
    TIMED_PHASES,
)

if TYPE_CHECKING:
    from torchtop.agent.hooks.probe import Probe

_NAMES = tuple(f"torchtop {p}" for p in TIMED_PHASES)


def wanted() -> bool:
    return os.environ.get("TORCHTOP_NVTX", "") not in ("", "0")


class NvtxPut:
    """An event step's `put`, with a range per phase (ranges nest as the phases do)."""

    __slots__ = ("_put", "_push", "_pop", "_comm")

    def __init__(
        self, put: Callable[[Any], None], push: Callable[[str], Any], pop: Callable[[], Any]
    ) -> None:
        self._put, self._push, self._pop = put, push, pop
        self._comm = False  # a `comm` range inside the open backward (COMM_READY): its exit closes both

    def __call__(self, item: Any) -> None:
        self._put(item)
        if type(item) is not int or item > MASK:
            return  # a time
        try:
            if item < GRAD:
                self._push(_NAMES[item])
            elif item == GRAD:
                self._push(_NAMES[BACKWARD])
            elif item == SAVE:
                self._push("torchtop checkpoint")
            elif item < 16:
                self._pop()
                if item == EXIT | BACKWARD and self._comm:
                    self._comm = False
                    self._pop()
            elif item >= FORWARD_START:
                self._push("torchtop forward")
            elif item == COMM_READY:
                self._comm = True
                self._push("torchtop comm")
            elif item == STEP_END:
                self._pop()  # the optimizer's exit and the step's end in one code
        except Exception:  # broad: NVTX ranges are optional; never into the training loop
            pass


def enable(probe: Probe, nvtx: Any) -> bool:
    """Event steps of `probe` put NVTX ranges (nvtx: torch.cuda.nvtx); False if it has none."""
    push, pop = getattr(nvtx, "range_push", None), getattr(nvtx, "range_pop", None)
    if push is None or pop is None:
        return False
    probe.event_put = NvtxPut(probe._put_with_events, push, pop)
    return True


__all__ = ["NvtxPut", "enable", "wanted"]
