"""A capture request's arguments, checked on the agent thread: which each command takes, their
types and ranges (the limits are the contract's: contract/capture.py). A refusal is a
CaptureError, whose message goes back to the client."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torchtop.contract.capture import (
    CAPTURE_DEFAULT_STEPS,
    MEMORY_MAX_STEPS,
    MEMORY_SECONDS,
    PROFILE_MAX_STEPS,
    CaptureKind,
)
from torchtop.contract.request_commands import Command

# at_step: start where the run's step count reaches it (a job's ranks capture the same steps)
PROFILE_ARGS = {
    "steps": int,
    "with_stack": bool,
    "record_shapes": bool,
    "profile_memory": bool,
    "at_step": int,
}
MEMORY_ARGS = {"steps": int, "seconds": (int, float), "at_step": int}


class CaptureError(ValueError):
    """A request refused; the message is sent back to the client."""


def _check_args(args: dict[str, Any], allowed: dict[str, Any]) -> None:
    for key, value in args.items():
        if key not in allowed:
            raise CaptureError(f"unknown argument {key[:64]!r}; allowed: {', '.join(allowed)}")
        kind = allowed[key]
        if isinstance(value, bool) and kind is not bool:
            raise CaptureError(f"argument {key!r} must be a number, not a boolean")
        if not isinstance(value, kind):
            raise CaptureError(f"argument {key!r} has the wrong type ({type(value).__name__})")


def validate(cmd: str, args: dict[str, Any], cuda: Callable[[], bool]) -> tuple[CaptureKind, int, float]:
    """What a capture request asks for: (kind, steps, seconds); `cuda` says whether this run uses
    CUDA (a memory snapshot needs it). Raises CaptureError with the reason otherwise."""
    at = args.get("at_step", 0)
    if isinstance(at, int) and not isinstance(at, bool) and at < 0:
        raise CaptureError(f"at_step must be a step number (0 or more), got {at}")
    if cmd == Command.CAPTURE_PROFILE:
        _check_args(args, PROFILE_ARGS)
        steps = args.get("steps", CAPTURE_DEFAULT_STEPS)
        if not 1 <= steps <= PROFILE_MAX_STEPS:
            raise CaptureError(f"steps must be in 1..{PROFILE_MAX_STEPS}, got {steps}")
        return CaptureKind.PROFILE, steps, 0.0
    if cmd == Command.CAPTURE_MEMORY:
        _check_args(args, MEMORY_ARGS)
        if not cuda():
            raise CaptureError("memory snapshots need CUDA; this run does not use it")
        if "steps" in args and "seconds" in args:
            raise CaptureError("give steps or seconds, not both")
        steps, seconds = args.get("steps", 0), float(args.get("seconds", 0.0))
        if "steps" in args and not 1 <= steps <= MEMORY_MAX_STEPS:
            raise CaptureError(f"steps must be in 1..{MEMORY_MAX_STEPS}, got {steps}")
        low, high = MEMORY_SECONDS
        if "seconds" in args and not low <= seconds <= high:
            raise CaptureError(f"seconds must be in {low:g}..{high:g}, got {seconds:g}")
        return CaptureKind.MEMORY, steps or (0 if seconds else CAPTURE_DEFAULT_STEPS), seconds
    raise CaptureError(f"unknown capture command {cmd!r}")
