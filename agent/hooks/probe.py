"""The training thread's side: a time and a code per event, appended to a bounded log.

All the training thread does for torchtop is here: `perf_counter_ns()`, two `list.append`s and,
on event steps, a CUDA `Event.record()` from a pool. The monitor makes steps of the log
(monitor/model/replay.py); step ends are the one decision taken here, because captures and CUDA
event steps act at step boundaries. The log, phase timing and the training-thread check are
described in docs/architecture.md.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from collections.abc import Callable
from contextvars import ContextVar
from time import perf_counter_ns
from types import CodeType
from typing import TYPE_CHECKING

from torchtop.agent.hooks.phase_sampling import ALL_TIMED, PERIOD, NoneTimed, PhaseSampling
from torchtop.agent.hooks.probe_drain import LogDrain
from torchtop.agent.hooks.step_hooks import StepHooks
from torchtop.contract.logcodes import (
    BACKWARD_STEPS,
    BOUNDARY,
    EXIT,
    H2D_COPY,
    MARK,
    MASK,
    OPEN_STEP,
    STEP_END,
    STEP_EVENT,
    TIMING_RESUMED,
    UNTIMED_END,
    Item,
)

if TYPE_CHECKING:
    import torch

    from torchtop.agent.loop.cuda_events import EventPool

LOG_CAP = 1 << 19  # items (two an entry, ~20 a step): a stalled agent thread costs at most ~10 MB
MAX_FAILURES = 20
FIRST_STEPS = 8  # steps with housekeeping at every boundary (discovery counts them)
# a loop with no optimizer.step() (weights updated by hand, an optimizer torchtop does not hook):
# after this many backward passes with no optimizer step and no step end, each backward's end
# ends a step (a few: gradient accumulation steps its optimizer after several backwards)
NO_OPT_BACKWARDS = 4


_current: ContextVar[Probe | None] = ContextVar("torchtop_probe", default=None)
current = _current.get  # the wrappers' check that they run on the training thread
if getattr(sys.flags, "thread_inherit_context", 0):  # new threads copy the context (3.14t): ask
    current = _current.__class__("torchtop_none", default=None).get  # the thread id every time


_discard = deque(maxlen=0).append  # `put` of a disabled probe: takes an item, keeps nothing


class Probe(LogDrain, PhaseSampling):
    """What the hooks call on the training thread. `tid` is that thread (0: switched off).

    `put(item)` appends one item; on an event step (CUDA events) it is swapped for a method
    that records an event with each time item, so the wrappers never test for sampling.
    `left` counts the boundaries until the next housekeeping (`housekeep`), so an ordinary
    boundary costs a decrement, a test and `untimed = plan[left]`. `untimed` is non-zero on a step
    whose phases are not timed (phase sampling): the wrappers pass straight through and its end
    is a UNTIMED_END. Housekeeping draws which of the next `left` steps are timed (`plan`).
    (The agent thread sets it to WAKE when no step ended for a second: the next root forward
    calls `wake()`, which times again. A root's no-grad forward is logged even then, and a
    second one with no step end between wakes at once: `nograd_untimed`.)
    """

    __slots__ = (
        "tid",
        "active",
        "log",
        "put",
        "_append",
        "lock",
        "depth",
        "left",
        "_batch",
        "_steps",
        "explicit",
        "on_step",
        "hooks",
        "failures",
        "dropped",
        "opt_fast",
        "opt_ran",
        "opt_depth",
        "_drained",
        "_shed_cuts",
        "pool",
        "event_every",
        "event_step",
        "_stream",
        "_record_ns",
        "cuda_marks",
        "untimed",
        "plan",
        "phase_every",
        "_hk_ns",
        "_hk_steps",
        "comm",
        "_nograd",
        "tail",
        "event_put",
        "no_opt",
        "engine",
        "callers",
        "funcol_group",
    )

    def __init__(self, thread_id: int | None = None) -> None:
        self.tid = thread_id if thread_id is not None else threading.get_ident()
        self.active = True
        self.log: list[Item] = []  # never replaced: the agent thread takes a prefix (drain)
        self._append = self.log.append
        self.put = self._append
        self.lock = threading.Lock()  # drain vs shedding the oldest entries
        self.depth = 0  # root forwards open (only the outermost is logged)
        self.left = self._batch = 1  # boundaries until housekeeping, of a batch of that many
        self._steps = 0  # training steps cut here, as of the last housekeeping
        self.explicit = False  # step() was used: the hooks stop cutting steps
        # the step-boundary hooks (captures, the FLOP count: hooks/step_hooks.py); `on_step` is
        # their runner while any is registered, else None (the boundary's one test)
        self.on_step: Callable[[], None] | None = None
        self.hooks = StepHooks(self)
        self.failures = 0
        self.dropped = 0  # steps lost to the log's bound
        self.opt_fast = False  # one optimizer, marked: the optimizer hooks' fast path
        self.opt_ran = False  # an optimizer stepped (GradScaler's skipped steps do not)
        self.opt_depth = 0  # optimizer steps open (a subclass's super().step() is not another)
        self._drained = 0  # step ends the agent thread has drained (or lost to shedding)
        self._shed_cuts = 0
        # CUDA sampling, driven by the agent thread: `pool` stays None off CUDA
        self.pool: EventPool | None = None
        self.event_every = 0
        self.event_step = False
        self._stream: torch.cuda.Stream | None = None
        self._record_ns = 0
        self.cuda_marks = False  # a mark holds a CUDA event: the agent must resolve it
        # phase sampling, decided at boundaries (housekeep): `untimed` is 0 on a timed step,
        # UNTIMED or WAKE on another; `phase_every` is 1 for every step timed, 0 for automatic
        # (by step time), N for about 1 step in N
        self.untimed = 0
        self.plan: list[int] = ALL_TIMED  # `untimed` of the step after the boundary that leaves `left`
        self.phase_every = 0
        self._hk_ns = 0
        self._hk_steps = 0
        # a process group of several ranks is in use (set by the agent thread): timed backwards
        # log where their compute ends, so the rest is collective wait (hooks/collectives.py)
        self.comm = False
        self._nograd: tuple[int, int] = (-1, -1)  # (steps, root code) of an untimed step's no-grad forward
        # the last pairs the agent thread drained: where the stack sampler reads the open explicit
        # phase when the log was just emptied (agent/telemetry/stacks.py)
        self.tail: list[Item] = []
        self.event_put: Callable[[Item], None] | None = (
            None  # an event step's put, if not the default (nvtx.py)
        )
        # backward passes left (+1) before steps are cut at each backward (NO_OPT_BACKWARDS); 1: they
        # are; 0: an optimizer stepped, or step() is explicit (the backward wrapper tests this)
        self.no_opt = NO_OPT_BACKWARDS + 1
        # a timed backward runs now: on CUDA the autograd engine runs its nodes on a thread of
        # its own, where FSDP2's backward all-gathers wait; the wait hooks log from it meanwhile
        # (hooks/waits.py), while the training thread is blocked in that backward
        self.engine = False
        # the code of the frames that called the first root module found (auto.py, once): where
        # the stack sampler finds the training loop (agent/telemetry/stacks.py)
        self.callers: tuple[CodeType, ...] = ()
        # the process group of the functional collective issued last on a timed step: its
        # wait_tensor names it (hooks/funcol_groups.py)
        self.funcol_group: object | None = None
        if thread_id is None:
            _current.set(self)

    @property
    def steps(self) -> int:
        """Training steps cut so far (exact on the training thread)."""
        return self._steps + self._batch - self.left

    # -- failure policy, threads -----------------------------------------------------------------
    def fail(self) -> None:
        self.failures += 1
        if self.failures >= MAX_FAILURES:
            self.disable()

    def disable(self) -> None:
        """No more entries: every wrapper passes straight through (stop, fork, failures)."""
        self.active = False
        self.tid = 0  # no thread has ident 0
        self.hooks.clear()  # sets on_step = None; a switched-off probe takes no more
        self.event_step = False
        self.comm = False
        self.put = self._append = _discard
        self.untimed = 0
        self.no_opt = 0
        self.engine = False
        self.plan = NoneTimed()  # type: ignore[assignment]
        self.left = self._batch = 1 << 30

    def adopt(self, claim: bool = False) -> Probe | None:
        """The calling context does not name this probe: if this is the training thread, it
        does from now on (a context copied before start(), a notebook cell); else None.

        `claim` (a backward or an optimizer step): before the first step is cut, the thread that
        calls it becomes the training thread, so a script that trains on a thread of its own
        (not the one that called start()) is measured; after it, the training thread is fixed."""
        ident = threading.get_ident()
        if ident != self.tid:
            if not (claim and self.active and self.steps == 0):
                return None
            self.tid = ident
        _current.set(self)
        return self

    def on_thread(self) -> bool:
        """On the training thread, and not switched off (the explicit API asks this)."""
        return self.active and (current() is self or self.adopt() is not None)

    # -- entries -------------------------------------------------------------------------------
    def stamp(self, code: int) -> None:
        """An entry with no payload and no CUDA event."""
        a = self._append
        a(perf_counter_ns())
        a(code)

    def enter(self, phase: int) -> None:
        put = self.put
        put(perf_counter_ns())
        put(phase)

    def exit(self, phase: int) -> None:
        put = self.put
        put(perf_counter_ns())
        put(EXIT | phase)

    forward = enter  # with a root forward's code: FORWARD_START + 2 * slot + grad

    def open_step(self) -> None:
        """`with step():` entered: boundaries are the user's from now on."""
        self.explicit = True
        self.opt_fast = False  # the optimizer hooks' fast path cuts steps
        self.no_opt = 0
        self.stamp(OPEN_STEP)

    def mark(self, name: str, value: float | tuple[torch.Tensor, torch.cuda.Event]) -> None:
        """A user scalar: a number, or a CUDA one being copied to pinned memory (tensor, done event)."""
        a = self._append
        a(perf_counter_ns())
        a((MARK, name, value))

    def h2d(
        self,
        start_ns: int,
        dt_ns: int,
        nbytes: int,
        pinned: bool,
        ev0: torch.cuda.Event | None,
        ev1: torch.cuda.Event | None,
    ) -> None:
        a = self._append
        a(start_ns)
        a((H2D_COPY, dt_ns, nbytes, pinned, ev0, ev1))

    # -- CUDA events ---------------------------------------------------------------------------
    def record(self) -> torch.cuda.Event | None:
        """A pooled event recorded now on this step's stream (None if the pool ran dry)."""
        pool = self.pool
        if pool is None:  # only event steps record, and they need a pool
            return None
        t = perf_counter_ns()
        ev = pool.recorded(self._stream)  # looked up once a step: current_stream() is slow
        self._record_ns += perf_counter_ns() - t
        return ev

    def _put_with_events(self, item: int) -> None:
        """`put` on an event step: a time item gets an event; a step end, the recording cost."""
        try:
            if item > MASK:
                self._append((item, self.record()))
            elif item == STEP_END or item == BOUNDARY:
                self._append((item, self._record_ns))
            else:
                self._append(item)
        except Exception:  # broad: never into the training loop (probe.fail counts it)
            self._append(item)
            self.fail()

    # -- step boundaries -----------------------------------------------------------------------
    def cut(self, code: int = BOUNDARY) -> None:
        """A training step ends now (BOUNDARY; STEP_END also closes the optimizer phase;
        UNTIMED_END on a step whose phases were not timed)."""
        put = self.put
        put(perf_counter_ns())
        put(UNTIMED_END if self.untimed else code)
        self.left -= 1
        if self.left <= 0 or self.on_step is not None:
            self.housekeep()
        else:
            self.untimed = self.plan[self.left]

    def backward_ended(self) -> None:
        """A timed backward returned and no optimizer has stepped yet (`no_opt`): after
        NO_OPT_BACKWARDS of them with no step end, steps end at each backward (BACKWARD_STEPS
        says so once; the step it closes held several backwards and is not reported)."""
        try:
            n = self.no_opt
            if n > 1:
                if self.steps:  # something else ends steps (a hook of a foreign optimizer)
                    self.no_opt = 0
                    return
                self.no_opt = n = n - 1
                if n > 1:
                    return
                self.stamp(BACKWARD_STEPS)
            if n == 1 and not self.explicit and not self.opt_depth:
                self.cut()
        except Exception:  # broad: never into the training loop (probe.fail counts it)
            self.fail()

    def wake(self) -> None:
        """A root forward in an untimed stretch that no step end has closed for a second (the
        agent thread set WAKE): an evaluation loop, or a pause. Phases are timed from now on
        (TIMING_RESUMED: the open step keeps its wall time only). Not on another thread's forward."""
        if not self.on_thread():
            return
        self.untimed = 0
        try:
            self.stamp(TIMING_RESUMED)
        except Exception:  # broad: never into the training loop (probe.fail counts it)
            self.fail()

    def nograd_untimed(self, code: int) -> None:
        """A root's no-grad forward on a step whose phases are not timed (training thread): it is
        logged, so the replay can tell evaluation from training. A second one of the same root
        with no step end between is an evaluation loop: its iterations are timed from here
        (wake), so each is cut as an eval step. One a step (a teacher or target network in a
        training step) leaves the sampling as it is."""
        try:
            steps = self.steps
            if self._nograd == (steps, code):
                self.wake()
            else:
                self._nograd = (steps, code)
        except Exception:  # broad: never into the training loop (probe.fail counts it)
            self.fail()

    def housekeep(self) -> None:
        """At a boundary, every `_batch` steps (each while something is due): end or start an
        event step, draw which of the next steps have their phases timed, bound the log, run
        the step-boundary hooks (in their order; the runner never raises)."""
        try:
            self._steps += self._batch - self.left
            self.untimed = 0
            if not self.active:
                self.left = self._batch = 1 << 30
                return
            if self.event_step:
                self.event_step = False
                self.put = self._append
            steps, batch, every = self._steps, PERIOD, self.event_every
            if self.pool is not None and every > 0:
                r = steps % every
                if r == 0:
                    self._stream = self.pool.current_stream()
                    self._record_ns = 0
                    self.event_step = True
                    self.put = self.event_put or self._put_with_events
                    self._append((perf_counter_ns(), self.record()))
                    self._append(STEP_EVENT)
                    batch = 1
                else:
                    batch = min(batch, every - r)
            n = len(self.log)
            if steps < FIRST_STEPS or n > LOG_CAP // 2:
                batch = 1
            one_in = self._one_in_timed(steps)
            if self.event_step or steps < FIRST_STEPS:
                one_in = 1
            self._plan(one_in, batch)
            self.left = self._batch = batch
            if n > LOG_CAP:
                self._shed()
        except Exception:  # broad: never into the training loop (probe.fail counts it)
            self.left = self._batch = 1
            self.fail()
        run = self.on_step
        if run is not None:
            try:
                run()
            except Exception:  # broad: never into the training loop (probe.fail counts it)
                self.fail()
