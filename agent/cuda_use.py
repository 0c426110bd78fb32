"""Whether the user's code uses CUDA: one check for the agent loop, the samplers and captures.

Never initialises CUDA itself (that would create a context in a CPU job), and asks at most once a
period: on a CPU build even the question is not free.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from types import ModuleType

PERIOD_S = 1.0


class CudaUse:
    def __init__(self, torch: ModuleType, period_s: float = PERIOD_S) -> None:
        self.torch = torch
        self.period_s = period_s
        self._initialised = False
        self._holds = False
        self._due = 0.0
        self._memory_due = 0.0

    def initialised(self, fresh: bool = False) -> bool:
        """The user's code initialised CUDA (asked at most once a period unless `fresh`)."""
        if self._initialised:
            return True
        now = time.monotonic()
        if not fresh and now < self._due:
            return False
        self._due = now + self.period_s
        try:
            cuda = self.torch.cuda
            self._initialised = bool(cuda.is_available() and cuda.is_initialized())
        except Exception:  # broad: a torch without usable CUDA may raise anything: not initialised
            return False
        return self._initialised

    def holds_memory(self) -> bool:
        """CUDA is initialised and holds memory on a GPU: torch.optim initialises CUDA on GPU
        machines even for a CPU loop, which must not pay for device timing it cannot use."""
        if self._holds:
            return True
        now = time.monotonic()
        if now < self._memory_due or not self.initialised():
            return False
        self._memory_due = now + self.period_s
        try:
            cuda = self.torch.cuda
            self._holds = any(cuda.memory_reserved(i) > 0 for i in range(cuda.device_count()))
        except Exception:  # broad: a torch without usable CUDA may raise anything: no memory held
            return False
        return self._holds
