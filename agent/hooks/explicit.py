"""Explicit instrumentation for what the automatic hooks cannot see.

    with torchtop.agent.step():          # one training step, boundaries set by you
        with torchtop.agent.phase("forward"):
            ...

Both are no-ops when the agent is not running, and never raise into the loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Generic, TypeVar

from torchtop.agent import core
from torchtop.agent.hooks.wrap import note_phase
from torchtop.agent.warn import warn
from torchtop.contract.logcodes import CHECKPOINT, DATA, FORWARD_START, SAVE, TIMED_PHASES

if TYPE_CHECKING:
    from torch import Tensor

T = TypeVar("T")
_PHASE_INDEX = {name: SAVE if i == CHECKPOINT else i for i, name in enumerate(TIMED_PHASES)}  # its code
_FORWARD = _PHASE_INDEX["forward"]
_warned: set[str] = set()


class _Step:
    """`with step():` marks a step boundary on exit; auto boundaries stop from the first use."""

    __slots__ = ()

    def __enter__(self) -> None:
        agent = core._agent
        if agent is None:
            return
        probe = agent.probe
        try:
            if probe.on_thread():
                probe.open_step()
        except Exception:  # broad: torchtop's API never raises into user code (probe.fail counts it)
            probe.fail()

    def __exit__(self, *exc: object) -> None:
        agent = core._agent
        if agent is None:
            return
        probe = agent.probe
        try:
            if probe.on_thread():
                probe.cut()
        except Exception:  # broad: torchtop's API never raises into user code (probe.fail counts it)
            probe.fail()


class _Phase:
    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __enter__(self) -> None:
        agent = core._agent
        if agent is None or self.index < 0:
            return
        probe = agent.probe
        try:
            if probe.on_thread():
                if self.index == _FORWARD:  # a no-grad forward in a step of its own is evaluation
                    probe.forward(FORWARD_START + agent.torch.is_grad_enabled())  # root slot 0
                else:
                    probe.enter(self.index)
        except Exception:  # broad: torchtop's API never raises into user code (probe.fail counts it)
            probe.fail()

    def __exit__(self, *exc: object) -> None:
        agent = core._agent
        if agent is None or self.index < 0:
            return
        probe = agent.probe
        try:
            if probe.on_thread():
                probe.exit(self.index)
        except Exception:  # broad: torchtop's API never raises into user code (probe.fail counts it)
            probe.fail()


_STEP = _Step()
_PHASES = {name: _Phase(i) for name, i in _PHASE_INDEX.items()}
_NO_PHASE = _Phase(-1)


def step() -> _Step:
    """A context manager around one training step."""
    return _STEP


def phase(name: str) -> _Phase:
    """A context manager timing one phase: data, h2d, forward, backward, optimizer, comm or checkpoint."""
    found = _PHASES.get(name)
    if found is None:
        if name not in _warned:
            _warned.add(name)
            warn(f"unknown phase {name!r} ignored; phases are {', '.join(TIMED_PHASES)}")
        return _NO_PHASE
    return found


def mark(name: str, value: float | Tensor) -> None:
    """Attach a user scalar (loss, tokens/s, lr) to the current step; shown by the monitor.

    A CUDA tensor is never read on the training thread (that would synchronize): it is copied
    to pinned memory without blocking, and the agent thread reads it once the copy has landed.
    """
    agent = core._agent
    if agent is None:
        return
    probe = agent.probe
    try:
        if not probe.on_thread():
            return
        if isinstance(value, (int, float)):
            probe.mark(name, float(value))
            return
        torch = agent.torch
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            if name not in _warned:
                _warned.add(name)
                warn(f"mark({name!r}) needs a number or a one-element tensor; ignored")
            return
        value = value.detach()
        if value.is_cuda:
            pinned = torch.empty((), dtype=value.dtype, pin_memory=True)
            pinned.copy_(value.reshape(()), non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            probe.cuda_marks = True  # the agent thread now looks for events to resolve
            probe.mark(name, (pinned, done))
        else:
            probe.mark(name, float(value))
    except Exception:  # broad: torchtop's API never raises into user code (probe.fail counts it)
        probe.fail()


class _TimedIterable(Generic[T]):
    """`for batch in torchtop.agent.data(iterable)`, or `next()` on it: each fetch on the training
    thread is timed as the data phase. For inputs the automatic hooks cannot see: a plain
    generator, a custom iterator. (DataLoaders and queue-fed prefetchers need no wrapper.)"""

    __slots__ = ("_it", "_pulled")

    def __init__(self, iterable: Iterable[T]) -> None:
        self._it = iterable
        self._pulled: Iterator[T] | None = None  # the timed iterator behind next() on this wrapper

    def __iter__(self) -> Iterator[T]:
        it = iter(self._it)
        data = _PHASES["data"]
        while True:
            data.__enter__()
            try:
                item = next(it)
            except StopIteration:
                return
            finally:
                data.__exit__()
            yield item

    def __next__(self) -> T:
        # `x, y = next(torchtop.agent.data(gen))`: a batch pulled by hand is timed the same way
        if self._pulled is None:
            self._pulled = self.__iter__()
        return next(self._pulled)

    def __len__(self) -> int:
        return len(self._it)  # type: ignore[arg-type]


note_phase(_TimedIterable.__iter__, DATA)  # its frame is on the stack only inside next()


def data(iterable: Iterable[T]) -> _TimedIterable[T]:
    """Wrap an iterable so the time spent fetching each item counts as the data phase."""
    return _TimedIterable(iterable)
