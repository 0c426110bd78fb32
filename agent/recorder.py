"""The agent thread's side of step timing: replays the probe's log into steps.

The training thread only logs timestamps (`probe.Probe`); here, off its path, the log becomes
steps with exclusive phase times: entering a phase pauses the one open (a `.to()` inside
forward), so a step's phases add up to at most its wall time and `other` is the remainder.
Steps are contiguous: a step runs from the previous boundary to this one, so the data wait
before a step's forward belongs to that step. Evaluation iterations (no-grad forwards, no
backward, no optimizer) are cut here too, at the next data fetch or the next forward of the
same root. A failure on an entry is counted and forgets the open step; it never stops the
agent thread.
"""

from __future__ import annotations

from typing import Any

from .probe import (
    BOUNDARY,
    EXIT,
    FORWARD_START,
    GRAD,
    H2D_COPY,
    MARK,
    MASK,
    MAX_FAILURES,
    OPEN_STEP,
    RESET,
    SHIFT,
    SKIPPED,
    STEP_EVENT,
)

# Phase indices; order matches wire.TIMED_PHASES.
DATA, H2D, FORWARD, BACKWARD, OPTIMIZER = range(5)
N_PHASES = 5


class StepRecorder:
    """Turns log entries into raw steps, in `out`:
    (index, kind, t0_ns, wall_ns, phases, micro, events, extra), `events` being None or
    [(phase, start event, end event), ..., record_ns] with phase -1 for the whole step.
    `give` returns CUDA events that pair with nothing to the pool."""

    __slots__ = (
        "give", "out", "failures", "explicit", "index", "_acc", "_cur", "_cur_t", "_stack", "_t0", "_micro",
        "_events", "_has_train", "_eval_fwd", "_eval_root", "_extra", "_prev_extra", "_fresh",
    )

    def __init__(self, give: Any = None) -> None:
        self.give = give
        self.out: list[tuple] = []
        self.failures = 0
        self.explicit = False  # step() was used: no eval cuts
        self.index = 0
        self._acc = [0] * N_PHASES
        self._cur = -1
        self._cur_t = 0
        self._stack: list[int] = []
        self._t0 = 0  # 0: no step open
        self._micro = 0
        self._events: list | None = None
        # what kind of step is open: train activity (grad forward, backward, optimizer) or only
        # no-grad forwards (an evaluation loop), and the first root of such a forward
        self._has_train = False
        self._eval_fwd = False
        self._eval_root = -1
        self._extra: dict[str, Any] | None = None  # rare per-step extras: marks, skipped, h2d bytes
        self._prev_extra: dict[str, Any] | None = None  # the extras of the step just handed over
        self._fresh = False  # nothing happened since the last boundary

    # -- the log -------------------------------------------------------------------------------
    def feed(self, entries: list[Any]) -> list[tuple]:
        """Replay `entries`; returns (and clears) the steps they completed."""
        enter, exit_, forward_start, boundary = self.enter, self.exit, self.forward_start, self.boundary
        for e in entries:
            if self.failures >= MAX_FAILURES:
                self._drop_events(e)
                continue
            try:
                if type(e) is int:  # most entries: dispatched here, without a call layer
                    code = e & MASK
                    if code < GRAD:
                        enter(code, e >> SHIFT)
                    elif code == GRAD:
                        enter(BACKWARD, e >> SHIFT, None, False)
                    elif code < 16:
                        exit_(code - EXIT, e >> SHIFT)
                    elif code >= FORWARD_START:
                        forward_start((code - FORWARD_START) >> 1, code & 1, e >> SHIFT)
                    elif code == BOUNDARY:
                        boundary("train", e >> SHIFT)
                    else:
                        self._entry(code, e >> SHIFT, None)
                else:
                    self._entry(e[0] & MASK, e[0] >> SHIFT, e)
            except Exception:
                self.failures += 1
                self._drop_events(e)
                self.reset()
        out, self.out = self.out, []
        return out

    def _entry(self, code: int, now: int, e: tuple | None) -> None:
        """Any entry, tuples included (those carry CUDA events, bytes, marks)."""
        ev = e[1] if e is not None and len(e) == 2 else None
        if code < GRAD:
            self.enter(code, now, ev)
        elif code == GRAD:
            self.enter(BACKWARD, now, ev, False)
        elif code < 16:
            self.exit(code - EXIT, now, ev)
        elif code >= FORWARD_START:
            self.forward_start((code - FORWARD_START) >> 1, code & 1, now, ev)
        elif code == BOUNDARY:
            self.boundary("train", now, *(e[1:] if e is not None else ()))
        elif code == STEP_EVENT:
            self.sample(ev)
        elif code == H2D_COPY:
            assert e is not None
            self.add_h2d(*e[1:])
        elif code == MARK:
            assert e is not None
            self.add_mark(e[1], e[2])
        elif code == OPEN_STEP:
            self.explicit = True
            self.open_step(now)
        elif code == SKIPPED:
            self.note_skipped()
        elif code == RESET:
            self.reset()

    def _drop_events(self, e: Any) -> None:
        """CUDA events of an entry that was not replayed go back to the pool."""
        if type(e) is tuple and self.give is not None:
            for x in e[1:]:
                if hasattr(x, "query"):
                    self.give(x)

    def _give(self, ev: Any) -> None:
        if ev is not None and self.give is not None:
            self.give(ev)

    # -- phases --------------------------------------------------------------------------------
    def enter(self, phase: int, now: int, ev: Any = None, micro: bool = True) -> None:
        """Open `phase` at `now`; a BACKWARD with `micro` (loss.backward(), not autograd.grad)
        that is not nested in another counts as a micro-batch."""
        if phase == DATA:
            if self._eval_fwd and not self._has_train and not self.explicit:
                self.boundary("eval", now)  # an evaluation iteration ends where the next fetch starts
        elif phase >= BACKWARD:
            self._has_train = True
            # only an outermost backward is a micro-batch: a reentrant checkpoint (or an
            # explicit phase("backward") around loss.backward()) nests a second one
            if phase == BACKWARD and micro and self._cur != BACKWARD and BACKWARD not in self._stack:
                self._micro += 1
        self._fresh = False
        if self._t0 == 0:
            self._open(now)
        cur = self._cur
        if cur >= 0:
            self._acc[cur] += now - self._cur_t
        self._stack.append(cur)
        self._cur = phase
        self._cur_t = now
        if ev is not None:
            if self._events is not None:
                self._events.append((phase, ev, None))
            else:
                self._give(ev)

    def exit(self, phase: int, now: int, ev: Any = None) -> None:
        cur = self._cur
        if cur >= 0:
            self._acc[cur] += now - self._cur_t
        if self._events is not None and ev is not None and phase == cur:
            # close the most recent open event pair of this phase
            evs = self._events
            for k in range(len(evs) - 1, 0, -1):
                p, start, end = evs[k]
                if p == phase and end is None:
                    evs[k] = (p, start, ev)
                    ev = None
                    break
        if ev is not None:
            self._give(ev)
        self._cur = self._stack.pop() if self._stack else -1
        self._cur_t = now

    def forward_start(self, root: int, grad: bool, now: int, ev: Any = None) -> None:
        """A root module's forward begins: tells train from evaluation, then opens FORWARD.

        No-grad forwards with no backward or optimizer in the step make it an `eval` step;
        without a DataLoader to cut at, the next forward of the same root cuts it.
        """
        if grad:
            self._has_train = True
        else:
            if self._eval_fwd and not self._has_train and root == self._eval_root and not self.explicit:
                self.boundary("eval", now)
            if not self._eval_fwd:
                self._eval_fwd, self._eval_root = True, root
        self.enter(FORWARD, now, ev)

    def _extras(self) -> dict[str, Any]:
        if self._extra is None:
            self._extra = {}
        return self._extra

    def add_h2d(self, dt_ns: int, nbytes: int = 0, pinned: bool = False, ev0: Any = None, ev1: Any = None) -> None:
        """Move `dt_ns` just spent in a host-to-device copy out of the open phase into h2d."""
        if self._t0 == 0:
            self._give(ev0)
            self._give(ev1)
            return
        self._acc[H2D] += dt_ns
        if self._cur >= 0:
            self._acc[self._cur] -= dt_ns
        if nbytes:
            extra = self._extras()
            key = "pinned" if pinned else "pageable"
            extra[key] = extra.get(key, 0) + nbytes
        if self._events is not None and ev0 is not None and ev1 is not None:
            self._events.append((H2D, ev0, ev1))
        else:
            self._give(ev0)
            self._give(ev1)

    def note_skipped(self) -> None:
        """An optimizer step that GradScaler skipped (inf/NaN gradients)."""
        extra = self._extras()
        extra["skipped"] = extra.get("skipped", 0) + 1

    def add_mark(self, name: str, value: Any) -> None:
        """A user scalar for this step: a float, or (pinned tensor, event) still on its way."""
        # a mark right after optimizer.step() (the usual place to log the loss) belongs to
        # the step that just ended, not to the one that has not started doing anything
        extra = self._prev_extra if self._fresh and self._prev_extra is not None else self._extras()
        marks = extra.setdefault("marks", [])
        if len(marks) < 64:
            marks.append((name, value))

    # -- steps ---------------------------------------------------------------------------------
    def open_step(self, now: int) -> None:
        """Open a step now if none is open (explicit `step()`)."""
        if self._t0 == 0:
            self._open(now)

    def _open(self, now: int) -> None:
        self._t0 = now
        self._events = None

    def sample(self, ev: Any) -> None:
        """The step just opened records CUDA events: `ev` marks its start on the GPU."""
        if self._t0 != 0 and self._events is None and ev is not None:
            self._events = [(-1, ev, None)]
        else:
            self._give(ev)

    def boundary(self, kind: str, now: int, end: Any = None, record_ns: int = 0) -> None:
        """End the open step at `now` and open the next one at once (steps are contiguous)."""
        if self._t0 == 0:
            self._give(end)
            return
        if self._cur >= 0:  # a phase spans the boundary: split it
            self._acc[self._cur] += now - self._cur_t
            self._cur_t = now
        events = self._events
        if events is not None:
            if end is None:  # an eval cut inside a sampled stretch: no end event, no device times
                for _, s, e in events:
                    self._give(s)
                    self._give(e)
                events = None
            else:
                events[0] = (-1, events[0][1], end)
                events.append(record_ns)
        else:
            self._give(end)
        if self._eval_fwd and not self._has_train:
            kind = "eval"
        extra = self._extra if self._extra is not None else {}
        self.out.append((self.index, kind, self._t0, now - self._t0, tuple(self._acc), self._micro, events, extra))
        self._prev_extra, self._fresh = extra, True
        self.index += 1
        self._acc = [0] * N_PHASES
        self._micro = 0
        self._has_train = self._eval_fwd = False
        self._extra = None
        self._open(now)

    def reset(self) -> None:
        """Forget the open step (entries were lost, or an entry failed)."""
        if self._events is not None:
            for _, s, e in self._events:
                self._give(s)
                self._give(e)
        self._t0 = 0
        self._cur = -1
        self._stack.clear()
        self._acc = [0] * N_PHASES
        self._micro = 0
        self._events = None
        self._has_train = self._eval_fwd = False
        self._extra = None
