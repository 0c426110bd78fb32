"""On-demand captures on the wire: what a request may ask for, a capture's kind and states, and
`CaptureInfo`, how far one got (carried by wire.py's Batch and Reply)."""

from __future__ import annotations

from enum import Enum
from typing import Any

import msgspec

# What a capture request may ask for: the agent refuses more, the TUI's keys and the CLI offer this.
CAPTURE_DEFAULT_STEPS = 5
PROFILE_MAX_STEPS = 100  # a profiler trace grows with every step it holds
MEMORY_MAX_STEPS = 1000
MEMORY_SECONDS = (0.1, 120.0)  # a memory capture by time: at least, at most


class _Name(str, Enum):
    """A state named by its string on the wire (and in JSON); compares equal to that string."""

    def __str__(self) -> str:
        return str(self.value)


class CaptureKind(_Name):
    PROFILE = "profile"  # a torch.profiler trace of N steps
    MEMORY = "memory"  # a CUDA memory snapshot after N steps or S seconds of allocator history


class CaptureState(_Name):
    PENDING = "pending"  # armed: waits for the training thread's next step boundary
    RUNNING = "running"
    WRITING = "writing"  # the files are written off the training thread
    DONE = "done"
    FAILED = "failed"


# tuples, not sets: a member's hash is its name's, so only equality matches a plain string
CAPTURE_ACTIVE = (CaptureState.PENDING, CaptureState.RUNNING, CaptureState.WRITING)
CAPTURE_FINISHED = (CaptureState.DONE, CaptureState.FAILED)


class CaptureInfo(msgspec.Struct, omit_defaults=True, frozen=True):
    """One on-demand capture (profiler trace or CUDA memory snapshot) and how far it got.

    Frozen: the agent thread publishes a new one at each change (see capture/controller.py)."""

    id: int
    kind: CaptureKind
    state: CaptureState
    steps_total: int = 0
    steps_done: int = 0
    seconds: float = 0.0
    path: str = ""  # on the agent's host
    host: str = ""
    error: str = ""
    note: str = ""  # where files go when not where asked, and why (the directory was refused)
    requested_at: float = 0.0
    started_at: float = 0.0
    finished_at: float = 0.0
    summary: dict[str, Any] = {}
    start_step: int = -1  # the run's step count where it started (the first step captured)
