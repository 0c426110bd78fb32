"""The probe's step-boundary hooks: who runs at a training step's boundary, in what order, and who
may take the step from whom.

A hook is a callback the training thread calls at every step boundary while it is registered
(`Probe.housekeep`, after the boundary's own housekeeping). Hooks run in ascending `order`
(`Order`: a capture before the FLOP count; equal orders in the order registered). The agent thread
registers and unregisters them; the training thread unregisters a hook whose work is done, and
a hook's own boundary opens its window with `open()`.

Hooks that change what a step measures (a profiler, a dispatch mode) are *exclusive*: at most one
is registered at a time, and one rule (`RULE`, a transition table in the manner of
`torch.profiler`'s `ProfilerAction`) says what a newcomer gets, from the holder's `Phase` and
whether the newcomer ranks before it (a lower `order`):

    holder       newcomer ranks first     newcomer ranks after
    none         TAKE                     TAKE
    ARMED        DISPLACE (holder gone)   WAIT
    OPEN         WAIT                     WAIT

WAIT refuses the registration: the newcomer asks again later (a capture asked for during the
counted FLOP step is armed once that step has ended; the FLOP count is armed once no capture
holds the boundary). A displaced hook is simply no longer registered; its owner sees that
(`holds`) and arms again later. Hooks that are not exclusive are always registered (`TAKE`).

The hot path pays nothing while no hook is registered: the probe's `on_step` is this list's
`run` only while the list is non-empty, else None (`cut()`'s one test). A hook that raises is
counted; after MAX_FAILURES it is removed (`removed` says why). Nothing raises into user code.

Threads: registration, displacement and `open()` take a lock (rare, microseconds); `run()` reads
an immutable tuple swapped in whole, so a boundary never waits for a registration.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from enum import Enum, IntEnum
from typing import Protocol

MAX_FAILURES = 3  # a hook raising this many times is removed


class Order(IntEnum):
    """Where a hook runs at a boundary (lower first), and so who ranks first for the step."""

    CAPTURE = 10  # a profiler or memory capture the user asked for (agent/capture/controller.py)
    FLOP_COUNT = 20  # the automatic one-step FLOP count (hooks/flop_step.py, telemetry/why.py)


class Phase(Enum):
    ARMED = "armed"  # registered; its window has not opened (its first boundary is ahead)
    OPEN = "open"  # its window is open: the steps it measures are under way


class Claim(Enum):
    TAKE = "take"  # registered
    DISPLACE = "displace"  # registered; the exclusive holder (armed, ranking after it) removed
    WAIT = "wait"  # refused: ask again later


# (holder's phase, the newcomer ranks first) -> what an exclusive newcomer gets
RULE: dict[tuple[Phase | None, bool], Claim] = {
    (None, True): Claim.TAKE,
    (None, False): Claim.TAKE,
    (Phase.ARMED, True): Claim.DISPLACE,
    (Phase.ARMED, False): Claim.WAIT,
    (Phase.OPEN, True): Claim.WAIT,
    (Phase.OPEN, False): Claim.WAIT,
}


class Owner(Protocol):
    """The probe, as the list sees it: the slot its boundaries test, and whether it is on."""

    on_step: Callable[[], None] | None
    active: bool


class _Hook:
    __slots__ = ("name", "callback", "order", "exclusive", "phase", "failures")

    def __init__(self, name: str, callback: Callable[[], object], order: int, exclusive: bool) -> None:
        self.name = name
        self.callback = callback
        self.order = order
        self.exclusive = exclusive
        self.phase = Phase.ARMED
        self.failures = 0


class StepHooks:
    """The ordered list of a probe's step-boundary hooks (see the module's docstring)."""

    def __init__(self, owner: Owner) -> None:
        self._owner = owner
        self._hooks: tuple[_Hook, ...] = ()  # sorted by order; replaced whole, never mutated
        self._lock = threading.Lock()
        self.removed: dict[str, str] = {}  # name -> the error that removed it (MAX_FAILURES)

    # -- any thread ------------------------------------------------------------------------------
    def claim(self, order: int, exclusive: bool = True, name: str = "") -> Claim:
        """What registering a hook of this order (and name) would get now (RULE), registering
        nothing. A hook of the same name is no holder: registering it again replaces it."""
        if not exclusive:
            return Claim.TAKE
        holder = next((h for h in self._hooks if h.exclusive and h.name != name), None)
        if holder is None:
            return Claim.TAKE
        return RULE[holder.phase, order < holder.order]

    def register(self, name: str, callback: Callable[[], object], order: int, exclusive: bool = True) -> bool:
        """Run `callback` at each boundary from the next one on (True), or WAIT (False). A hook
        of the same name is replaced. Never on a probe that is switched off."""
        with self._lock:
            if not self._owner.active:
                return False
            claim = self.claim(order, exclusive, name)
            if claim is Claim.WAIT:
                return False
            kept = [
                h for h in self._hooks if h.name != name and not (claim is Claim.DISPLACE and h.exclusive)
            ]
            kept.append(_Hook(name, callback, order, exclusive))
            kept.sort(key=lambda h: h.order)  # stable: equal orders keep the order registered
            self.removed.pop(name, None)
            self._set(tuple(kept))
        return True

    def unregister(self, name: str, callback: Callable[[], object] | None = None) -> None:
        """Remove the hook `name` (only if it is still `callback`, when given); no-op if absent."""
        with self._lock:
            self._remove(name, callback)

    def open(self, name: str, callback: Callable[[], object]) -> bool:
        """Training thread, in the hook's boundary: its window opens (ARMED -> OPEN). False when
        it was displaced or unregistered meanwhile: then it must not start anything."""
        with self._lock:
            for h in self._hooks:
                if h.name == name and h.callback == callback:
                    h.phase = Phase.OPEN
                    return True
        return False

    def holds(self, name: str, callback: Callable[[], object] | None = None) -> bool:
        """The hook `name` (that callback, when given) is registered."""
        return any(h.name == name and (callback is None or h.callback == callback) for h in self._hooks)

    def phase(self, name: str) -> Phase | None:
        return next((h.phase for h in self._hooks if h.name == name), None)

    def names(self) -> list[str]:
        """The registered hooks, in the order they run."""
        return [h.name for h in self._hooks]

    def clear(self) -> None:
        with self._lock:
            self._set(())

    # -- training thread: at a boundary, while any is registered ---------------------------------
    def run(self) -> None:
        """Each hook in order. One that raises is counted, and removed at MAX_FAILURES; never raises."""
        for h in self._hooks:
            try:
                h.callback()
            except Exception as exc:  # broad: a hook's failure is counted, never raised
                try:
                    h.failures += 1
                    if h.failures >= MAX_FAILURES:
                        with self._lock:
                            if self._remove(h.name, h.callback):
                                self.removed[h.name] = f"{type(exc).__name__}: {exc}"[:200]
                except Exception:  # broad: counting a failure must not fail the step
                    pass

    # -- under the lock ----------------------------------------------------------------------------
    def _remove(self, name: str, callback: Callable[[], object] | None) -> bool:
        kept = tuple(
            h for h in self._hooks if not (h.name == name and (callback is None or h.callback == callback))
        )
        if len(kept) == len(self._hooks):
            return False
        self._set(kept)
        return True

    def _set(self, hooks: tuple[_Hook, ...]) -> None:
        self._hooks = hooks
        self._owner.on_step = self.run if hooks else None  # the boundary's one test
