"""Explicit instrumentation for what the automatic hooks cannot see.

    with torchtop.agent.step():          # one training step, boundaries set by you
        with torchtop.agent.phase("forward"):
            ...

Both are no-ops when the agent is not running, and never raise into the loop.
"""

from __future__ import annotations

from typing import Any

from . import core
from .core import warn
from .wire import TIMED_PHASES

_PHASE_INDEX = {name: i for i, name in enumerate(TIMED_PHASES)}
_warned: set[str] = set()


class _Step:
    """`with step():` marks a step boundary on exit; auto boundaries stop from the first use."""

    __slots__ = ()

    def __enter__(self) -> None:
        agent = core._agent
        if agent is None:
            return
        rec = agent.recorder
        if rec.on_thread():
            rec.explicit = True
            rec.open_step()

    def __exit__(self, *exc: Any) -> None:
        agent = core._agent
        if agent is not None and agent.recorder.on_thread():
            agent.recorder.boundary()


class _Phase:
    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __enter__(self) -> None:
        agent = core._agent
        if agent is not None and self.index >= 0 and agent.recorder.on_thread():
            agent.recorder.enter(self.index)

    def __exit__(self, *exc: Any) -> None:
        agent = core._agent
        if agent is not None and self.index >= 0 and agent.recorder.on_thread():
            agent.recorder.exit(self.index)


_STEP = _Step()
_PHASES = {name: _Phase(i) for name, i in _PHASE_INDEX.items()}
_NO_PHASE = _Phase(-1)


def step() -> _Step:
    """A context manager around one training step."""
    return _STEP


def phase(name: str) -> _Phase:
    """A context manager timing one phase: data, h2d, forward, backward or optimizer."""
    found = _PHASES.get(name)
    if found is None:
        if name not in _warned:
            _warned.add(name)
            warn(f"unknown phase {name!r} ignored; phases are {', '.join(TIMED_PHASES)}")
        return _NO_PHASE
    return found
