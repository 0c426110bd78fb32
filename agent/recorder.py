"""The training thread's side: phase clocks and step boundaries.

Everything here runs on the training thread, inside user code, so it does only what the hot
path allows: `perf_counter_ns()`, list arithmetic, optional CUDA `Event.record()` from a pool,
and one append to a bounded buffer per step. Every public method swallows its own failures
(counted) and the recorder switches itself off after repeated ones: it never raises into
training.
"""

from __future__ import annotations

import threading
from time import perf_counter_ns
from typing import Any

from .buffer import DropOldestBuffer

# Phase indices; order matches wire.TIMED_PHASES.
DATA, H2D, FORWARD, BACKWARD, OPTIMIZER = range(5)
N_PHASES = 5
MAX_FAILURES = 20


class StepRecorder:
    """Accumulates exclusive host time per phase and cuts steps at boundaries.

    Phases nest (a `.to()` inside forward): entering a phase pauses the one open, so the phase
    times of a step add up to at most its wall time, and `other` is the remainder.
    Steps are contiguous: a step runs from the previous boundary to this one, so the data wait
    before a step's forward belongs to that step.
    """

    def __init__(self, buffer: DropOldestBuffer, thread_id: int | None = None) -> None:
        self.buffer = buffer
        self.thread_id = thread_id if thread_id is not None else threading.get_ident()
        self.active = True
        self.failures = 0
        self.explicit = False  # set once the user calls step(): auto boundaries stop
        self.index = 0
        self._acc = [0] * N_PHASES
        self._cur = -1
        self._cur_t = 0
        self._stack: list[int] = []
        self._t0 = 0  # 0: no step open
        self._micro = 0
        self._kind = "train"
        # CUDA sampling, driven by the agent thread: `pool` is None off CUDA.
        self.pool: Any = None
        self.sample_every = 0
        self._events: list | None = None
        self._record_ns = 0
        self.on_step: Any = None  # set while a capture is armed: called at each boundary
        self._stream: Any = None  # the CUDA stream events of this (sampled) step are recorded on
        # what kind of step is open: train activity (grad forward, backward, optimizer) or only
        # no-grad forwards (an evaluation loop), and the first root module of such a forward
        self._has_train = False
        self._eval_fwd = False
        self._eval_root = 0
        self._extra: dict[str, Any] | None = None  # rare per-step extras: marks, skipped, h2d bytes
        self._prev_extra: dict[str, Any] | None = None  # the extras of the step just handed over
        self._fresh = False  # nothing happened since the last boundary

    # -- failure policy ------------------------------------------------------------------------
    def _fail(self) -> None:
        self.failures += 1
        if self.failures >= MAX_FAILURES:
            self.active = False

    def on_thread(self) -> bool:
        return self.active and threading.get_ident() == self.thread_id

    # -- CUDA events ---------------------------------------------------------------------------
    def _record(self) -> Any:
        t = perf_counter_ns()
        ev = self.pool.take()
        if ev is not None:
            ev.record(self._stream)  # the stream looked up once a step: current_stream() costs ~4 us
        self._record_ns += perf_counter_ns() - t
        return ev

    # -- phases --------------------------------------------------------------------------------
    def enter(self, phase: int, opens_step: bool = True) -> None:
        """Open `phase`; `opens_step` says whether it may start a step when none is open."""
        try:
            if phase == DATA:
                if self._eval_fwd and not self._has_train and not self.explicit:
                    self.boundary("eval")  # an evaluation iteration ends where the next fetch starts
            elif phase == BACKWARD or phase == OPTIMIZER:
                self._has_train = True
            self._fresh = False
            now = perf_counter_ns()
            if self._t0 == 0:
                if not opens_step:
                    self._stack.append(self._cur)
                    self._cur = -2  # outside any step: ignored until exit
                    return
                self._open_step(now)
            if self._cur >= 0:
                self._acc[self._cur] += now - self._cur_t
            self._stack.append(self._cur)
            self._cur = phase
            self._cur_t = now
            if phase == BACKWARD and BACKWARD not in self._stack:
                # only an outermost backward is a micro-batch: a reentrant checkpoint (or an
                # explicit phase("backward") around loss.backward()) nests a second one
                self._micro += 1
            if self._events is not None:
                self._events.append((phase, self._record(), None))
        except Exception:
            self._fail()

    def exit(self, phase: int) -> None:
        try:
            now = perf_counter_ns()
            cur = self._cur
            if cur == -2:
                self._cur = self._stack.pop() if self._stack else -1
                return
            if cur >= 0:
                self._acc[cur] += now - self._cur_t
            if self._events is not None and phase == cur:
                # close the most recent open event pair of this phase
                evs = self._events
                for k in range(len(evs) - 1, -1, -1):
                    p, start, end = evs[k]
                    if p == phase and end is None:
                        evs[k] = (p, start, self._record())
                        break
            self._cur = self._stack.pop() if self._stack else -1
            self._cur_t = now
        except Exception:
            self._fail()

    def forward_start(self, root_id: int, grad: bool) -> None:
        """A root module's forward begins: tells train from evaluation, then opens FORWARD.

        No-grad forwards with no backward or optimizer in the step make it an `eval` step;
        without a DataLoader to cut at, the next forward of the same root cuts it.
        """
        try:
            if grad:
                self._has_train = True
            else:
                if self._eval_fwd and not self._has_train and root_id == self._eval_root and not self.explicit:
                    self.boundary("eval")
                if not self._eval_fwd:
                    self._eval_fwd, self._eval_root = True, root_id
        except Exception:
            self._fail()
        self.enter(FORWARD)

    def _extras(self) -> dict[str, Any]:
        if self._extra is None:
            self._extra = {}
        return self._extra

    def add_h2d(self, dt_ns: int, nbytes: int = 0, pinned: bool = False) -> None:
        """Move `dt_ns` just spent in a host-to-device copy out of the open phase into h2d."""
        try:
            if self._t0 == 0:
                return
            self._acc[H2D] += dt_ns
            if self._cur >= 0:
                self._acc[self._cur] -= dt_ns
            if nbytes:
                extra = self._extras()
                key = "pinned" if pinned else "pageable"
                extra[key] = extra.get(key, 0) + nbytes
        except Exception:
            self._fail()

    def note_skipped(self) -> None:
        """An optimizer step that GradScaler skipped (inf/NaN gradients)."""
        try:
            extra = self._extras()
            extra["skipped"] = extra.get("skipped", 0) + 1
        except Exception:
            self._fail()

    def add_mark(self, name: str, value: Any) -> None:
        """A user scalar for this step: a float, or (pinned tensor, event) still on its way."""
        try:
            # a mark right after optimizer.step() (the usual place to log the loss) belongs to
            # the step that just ended, not to the one that has not started doing anything
            extra = self._prev_extra if self._fresh and self._prev_extra is not None else self._extras()
            marks = extra.setdefault("marks", [])
            if len(marks) < 64:
                marks.append((name, value))
        except Exception:
            self._fail()

    def h2d_events(self) -> bool:
        return self._events is not None and self._t0 != 0

    def add_h2d_events(self, start: Any, end: Any) -> None:
        try:
            if self._events is not None:
                self._events.append((H2D, start, end))
        except Exception:
            self._fail()

    # -- steps ---------------------------------------------------------------------------------
    def open_step(self) -> None:
        """Open a step now if none is open (explicit `step()`)."""
        try:
            if self._t0 == 0:
                self._open_step(perf_counter_ns())
        except Exception:
            self._fail()

    def _open_step(self, now: int) -> None:
        self._t0 = now
        self._record_ns = 0
        every = self.sample_every
        if self.pool is not None and every > 0 and self.index % every == 0:
            self._stream = self.pool.current_stream()
            self._events = [(-1, self._record(), None)]  # boundary event at step start
        else:
            self._events = None

    def boundary(self, kind: str = "train") -> None:
        """End the open step now and open the next one at once (steps are contiguous)."""
        try:
            now = perf_counter_ns()
            if self._t0 == 0:
                return
            if self._cur >= 0:  # a phase spans the boundary: split it
                self._acc[self._cur] += now - self._cur_t
                self._cur_t = now
            events = self._events
            if events is not None:
                events[0] = (-1, events[0][1], self._record())
                events.append(self._record_ns)
            if self._eval_fwd and not self._has_train:
                kind = "eval"
            extra = self._extra if self._extra is not None else {}
            # (index, kind, t0_ns, wall_ns, phases, micro, events, extra): decoded by the agent thread
            self.buffer.append(
                (self.index, kind, self._t0, now - self._t0, tuple(self._acc), self._micro, events, extra)
            )
            self._prev_extra, self._fresh = extra, True
            self.index += 1
            self._acc = [0] * N_PHASES
            self._micro = 0
            self._has_train = self._eval_fwd = False
            self._extra = None
            self._open_step(now)
        except Exception:
            self._fail()
        if self.on_step is not None:
            try:
                self.on_step()
            except Exception:
                self.on_step = None

    def reset(self) -> None:
        """Forget the open step (after stop/start, or a fork)."""
        self._t0 = 0
        self._cur = -1
        self._stack.clear()
        self._acc = [0] * N_PHASES
        self._micro = 0
        self._events = None
        self._has_train = self._eval_fwd = False
        self._extra = None
