# pyright: basic
# basic, not strict: the recorder's raw step tuples are untyped for speed (a typed record per step costs the replay)
"""The monitor's side of step timing: replays an agent's log into steps.

The training thread logs times and codes (agent/hooks/probe.py); here they become steps with
exclusive phases (entering one pauses the one open, so they add up to the wall time and `other`
is the rest), evaluation iterations are cut at the next data fetch or forward of the same root,
and an untimed step (UNTIMED_END) keeps its wall time only; it always ends a training step
(the no-grad forwards an untimed stretch logs, a teacher's or an eval pass's first, do not make
it an eval step). Device times arrive resolved (each event's ms from the step's start); a wait
pauses the phase around it on the GPU as on the host. A malformed entry is counted and forgets the open step. COMM_READY
inside a backward ends its compute: the rest of that backward is `comm` (the wait for DDP's
all-reduce). Details: docs/architecture.md, "The log".
"""

from __future__ import annotations

from typing import Any

from torchtop.contract.logcodes import (
    BACKWARD,
    BACKWARD_STEPS,
    BOUNDARY,
    CHECKPOINT,
    COMM,
    COMM_GROUP,
    COMM_READY,
    DATA,
    EXIT,
    FORWARD,
    FORWARD_START,
    GRAD,
    H2D,
    H2D_COPY,
    MARK,
    MASK,
    OPEN_STEP,
    OPTIMIZER,
    RESET,
    SAVE,
    SHIFT,
    SKIPPED,
    STEP_END,
    STEP_EVENT,
    TIMED_PHASES,
    TIMING_RESUMED,
    UNTIMED_END,
    WORK,
)
from torchtop.monitor.model.step_pack import close_pair as _close
from torchtop.monitor.model.step_pack import drop_open as _drop_open
from torchtop.monitor.model.step_pack import finite_ms, open_start, phase_ms
from torchtop.monitor.model.steps import StepKind

__all__ = ["BACKWARD", "CHECKPOINT", "COMM", "DATA", "FORWARD", "H2D", "OPTIMIZER", "StepRecorder"]
SAVE_EXIT = EXIT | SAVE
N_PHASES = len(TIMED_PHASES)


class StepRecorder:
    """Turns log entries into raw steps, in `out`:
    (index, kind, t0_ns, wall_ns, phases, micro, device_ms, extra), `device_ms` being None for a
    step not sampled for CUDA timing. `failures` counts malformed entries (each skipped)."""

    __slots__ = (
        "out",
        "failures",
        "explicit",
        "index",
        "_acc",
        "_cur",
        "_cur_t",
        "_stack",
        "_t0",
        "_micro",
        "_events",
        "_has_train",
        "_eval_fwd",
        "_eval_root",
        "_extra",
        "_prev_extra",
        "_fresh",
        "partial",
        "_untimed",
        "_split",
        "_group",
        "_paused",
        "by_backward",
        "_opt_base",
    )

    def __init__(self) -> None:
        self.out: list[tuple] = []
        # the open step began before the entries seen (a replay joining late, or after lost
        # entries): it is not reported, unless a step boundary opened it
        self.partial = False
        self.failures = 0
        self.explicit = False  # step() was used: no eval cuts
        self.index = 0
        self._acc = [0] * N_PHASES
        self._cur = -1
        self._cur_t = 0
        self._stack: list[int] = []
        self._t0 = 0  # 0: no step open
        self._micro = 0
        # an event step's device times: [(phase, start ms, end ms)], phase -1 the whole step
        self._events: list | None = None
        # what kind of step is open: train activity (grad forward, backward, optimizer) or only
        # no-grad forwards (an evaluation loop), and the first root of such a forward
        self._has_train = False
        self._eval_fwd = False
        self._eval_root = -1
        self._extra: dict[str, Any] | None = None  # rare per-step extras: marks, skipped, h2d bytes
        self._prev_extra: dict[str, Any] | None = None  # the extras of the step just handed over
        self._fresh = False  # nothing happened since the last boundary
        self._untimed = False  # the open step's phases were not all timed (TIMING_RESUMED in it)
        self._split = False  # the open `comm` is the rest of a backward (COMM_READY): its exit closes it
        # the open collective's (group, start, depth, device start ms or None)
        self._group: tuple[str, int, int, float | None] | None = None
        self._paused: list[bool] = []  # per open wait: it paused its phase's device pair
        # the agent saw no optimizer.step(): steps end at each backward (BACKWARD_STEPS) until one is
        self.by_backward = False
        # the optimizer's time before the segment now open: a forward or backward inside its step
        # (the closure of optimizer.step(closure), Lightning's training_step) makes the segment
        # before it the closure's own code, counted as other, not as the optimizer
        self._opt_base = 0

    # -- the log -------------------------------------------------------------------------------
    def feed(self, entries: list[Any]) -> list[tuple]:
        """Replay `entries`; returns (and clears) the steps they completed."""
        enter, exit_, forward_start, boundary = self.enter, self.exit, self.forward_start, self.boundary
        for e in entries:
            try:
                if type(e) is int:  # most entries: dispatched here, without a call layer
                    code = e & MASK
                    if code < GRAD:
                        enter(code, e >> SHIFT)
                    elif code == GRAD:
                        enter(BACKWARD, e >> SHIFT, None, False)
                    elif code == SAVE:
                        enter(CHECKPOINT, e >> SHIFT)
                    elif code == SAVE_EXIT:
                        exit_(CHECKPOINT, e >> SHIFT)
                    elif code < 16:
                        exit_(code - EXIT, e >> SHIFT)
                    elif code >= FORWARD_START:
                        forward_start((code - FORWARD_START) >> 1, code & 1, e >> SHIFT)
                    elif code == STEP_END:
                        exit_(OPTIMIZER, e >> SHIFT)
                        boundary("train", e >> SHIFT)
                    elif code == BOUNDARY:
                        boundary("train", e >> SHIFT)
                    elif code == UNTIMED_END:
                        boundary("train", e >> SHIFT, None, False)
                    else:
                        self._entry(code, e >> SHIFT, None)
                else:
                    self._entry(e[0] & MASK, e[0] >> SHIFT, e)
            except Exception:  # broad: hostile or corrupt input: counted, the replay reset
                self.failures += 1
                self.reset()
        out, self.out = self.out, []
        return out

    def _entry(self, code: int, now: int, e: Any) -> None:  # e: the packed tuple entry, or None
        """Any entry, tuples included (those carry device times, bytes, marks)."""
        if now < 0:
            raise ValueError("negative time stamp")
        ms = finite_ms(e[1]) if e is not None and len(e) == 2 and code != COMM_GROUP else None
        if code < GRAD:
            self.enter(code, now, ms)
        elif code == GRAD:
            self.enter(BACKWARD, now, ms, False)
        elif code == SAVE:
            self.enter(CHECKPOINT, now, ms)
        elif code == SAVE_EXIT:
            self.exit(CHECKPOINT, now, ms)
        elif code < 16:
            self.exit(code - EXIT, now, ms)
        elif code >= FORWARD_START:
            self.forward_start((code - FORWARD_START) >> 1, code & 1, now, ms)
        elif code == BOUNDARY:
            self.boundary("train", now, finite_ms(e[1]) if e is not None else None)
        elif code == STEP_END:  # the optimizer's end and the step's: one time, one event
            ms = finite_ms(e[1]) if e is not None else None
            self.exit(OPTIMIZER, now, ms)
            self.boundary("train", now, ms)
        elif code == UNTIMED_END:
            self.boundary("train", now, None, False)
        elif code == TIMING_RESUMED:
            self._untimed = True
        elif code == BACKWARD_STEPS:
            self.by_backward = True
            if self._t0:  # the step it closes holds the backwards counted before: not one step
                self.partial = True
        elif code == COMM_READY:
            self.comm_ready(now, ms)
        elif code == STEP_EVENT:
            self.sample(ms)
        elif code == H2D_COPY:
            assert e is not None
            _, dt, nbytes, pinned, device_ms = e
            self.add_h2d(int(dt), int(nbytes), bool(pinned), finite_ms(device_ms))
        elif code == MARK:
            assert e is not None
            self.add_mark(str(e[1]), e[2])
        elif code == COMM_GROUP:
            assert e is not None
            if self._cur == COMM and self._t0:
                self._group = (str(e[1]), now, len(self._stack), open_start(self._events, COMM))
        elif code == WORK:
            assert e is not None
            self.add_work(int(e[1]), int(e[2]), int(e[3]))
        elif code == OPEN_STEP:
            self.explicit = True
            self.open_step(now)
        elif code == SKIPPED:
            self.note_skipped()
        elif code == RESET:
            self.reset()
        else:
            raise ValueError(f"unknown log code {code}")

    # -- phases --------------------------------------------------------------------------------
    def enter(self, phase: int, now: int, ms: float | None = None, micro: bool = True) -> None:
        """Open `phase` at `now`; a BACKWARD with `micro` (loss.backward(), not autograd.grad)
        that is not nested in another counts as a micro-batch."""
        if phase == DATA:
            if self._eval_fwd and not self._has_train and not self.explicit:
                self.boundary("eval", now)  # an evaluation iteration ends where the next fetch starts
        elif phase == CHECKPOINT:  # a save: counted on every step, timed or not (to_record)
            extra = self._extras()
            extra["saves"] = extra.get("saves", 0) + 1
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
        evs = self._events
        if cur == OPTIMIZER and (phase == FORWARD or phase == BACKWARD):
            self._acc[OPTIMIZER] = self._opt_base  # the closure's code so far: other
            if evs is not None:
                _drop_open(evs, OPTIMIZER)
        elif cur >= 0:
            self._acc[cur] += now - self._cur_t
        if phase == OPTIMIZER:
            self._opt_base = self._acc[OPTIMIZER]
        self._stack.append(cur)
        self._cur = phase
        self._cur_t = now
        if phase == COMM:  # a wait inside forward/backward pauses them on the GPU too
            self._paused.append(ms is not None and evs is not None and cur >= 0 and _close(evs, cur, ms))
        if ms is not None and evs is not None:
            evs.append((phase, ms, None))

    def comm_ready(self, now: int, ms: float | None = None) -> None:
        """The open backward's compute is done (an autograd final callback ran before DDP's):
        from here to its exit it waits for collectives. Outside a backward it means nothing."""
        if self._cur != BACKWARD or self._t0 == 0:
            return
        self._acc[BACKWARD] += now - self._cur_t
        self._cur, self._cur_t, self._split = COMM, now, True
        evs = self._events
        if evs is not None and ms is not None and _close(evs, BACKWARD, ms):
            evs.append((COMM, ms, None))

    def exit(self, phase: int, now: int, ms: float | None = None) -> None:
        cur = self._cur
        nested = phase == FORWARD or phase == BACKWARD
        paused = phase == COMM and bool(self._paused) and self._paused.pop()
        if self._group is not None and phase == COMM and len(self._stack) == self._group[2]:
            self._close_group(now, ms)
        if phase == OPTIMIZER:
            self.by_backward = False  # an optimizer stepped: steps end there from now
        if self._split and phase == BACKWARD and cur == COMM:
            phase, self._split = COMM, False  # the backward's exit closes its collective wait
        if cur >= 0:
            self._acc[cur] += now - self._cur_t
        if self._events is not None and ms is not None and phase == cur:
            _close(self._events, phase, ms)
        self._cur = self._stack.pop() if self._stack else -1
        self._cur_t = now
        if paused and self._events is not None and ms is not None and self._cur >= 0:
            self._events.append((self._cur, ms, None))  # the phase the wait paused goes on
        if self._cur == OPTIMIZER:
            self._opt_base = self._acc[OPTIMIZER]  # back in the optimizer's own code
            if nested and self._events is not None and ms is not None:
                self._events.append((OPTIMIZER, ms, None))  # its pair, dropped at the closure's forward

    def forward_start(self, root: int, grad: int, now: int, ms: float | None = None) -> None:
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
        self.enter(FORWARD, now, ms)

    def _extras(self) -> dict[str, Any]:
        if self._extra is None:
            self._extra = {}
        return self._extra

    def add_h2d(
        self, dt_ns: int, nbytes: int = 0, pinned: bool = False, device_ms: float | None = None
    ) -> None:
        """Move `dt_ns` just spent in a host-to-device copy out of the open phase into h2d."""
        if self._t0 == 0:
            return
        self._acc[H2D] += dt_ns
        if self._cur >= 0:
            self._acc[self._cur] -= dt_ns
        if nbytes:
            extra = self._extras()
            key = "pinned" if pinned else "pageable"
            extra[key] = extra.get(key, 0) + nbytes
        if self._events is not None and device_ms is not None:
            self._events.append((H2D, 0.0, device_ms))

    def note_skipped(self) -> None:
        """An optimizer step that GradScaler skipped (inf/NaN gradients)."""
        extra = self._extras()
        extra["skipped"] = extra.get("skipped", 0) + 1

    def _close_group(self, now: int, ms: float | None) -> None:
        """The collective named by COMM_GROUP returns: its time counts for its process group, on
        the host and, on an event step, on the GPU (the compute stream's wait for it)."""
        assert self._group is not None
        name, start, _, start_ms = self._group
        self._group = None
        groups = self._extras().setdefault("comm_groups", {})
        if len(groups) < 16 or name in groups:
            groups[name] = groups.get(name, 0) + max(0, now - start)
            if start_ms is not None and ms is not None:
                dev = self._extras().setdefault("device_groups", {})
                dev[name] = dev.get(name, 0.0) + max(0.0, ms - start_ms)

    def add_work(self, samples: int, tokens: int, seq: int) -> None:
        """A root forward's batch: samples and tokens add up over micro-batches."""
        if samples < 0 or tokens < 0 or seq < 0:
            raise ValueError("negative work")
        extra = self._extras()
        extra["samples"] = extra.get("samples", 0) + samples
        extra["tokens"] = extra.get("tokens", 0) + tokens
        extra["seq"] = max(extra.get("seq", 0), seq)

    def add_mark(self, name: str, value: Any) -> None:
        """A user scalar for this step."""
        # a mark right after optimizer.step() (the usual place to log the loss) belongs to
        # the step that just ended, not to the one that has not started doing anything
        extra = self._prev_extra if self._fresh and self._prev_extra is not None else self._extras()
        marks = extra.setdefault("marks", {})
        if len(marks) < 64 and value is not None:
            marks[name] = float(value)

    # -- steps ---------------------------------------------------------------------------------
    def open_step(self, now: int) -> None:
        """Open a step now if none is open (explicit `step()`)."""
        if self._t0 == 0:
            self._open(now)
            self.partial = False

    def _open(self, now: int) -> None:
        self._t0 = now
        self._events = None

    def sample(self, ms: float | None) -> None:
        """The step just opened has CUDA device times; `ms` (0.0) marks its start on the GPU."""
        if self._t0 != 0 and self._events is None and ms is not None:
            self._events = [(-1, ms, None)]

    def boundary(self, kind: StepKind, now: int, end_ms: float | None = None, timed: bool = True) -> None:
        """End the open step at `now` and open the next one at once (steps are contiguous).
        With no step open (the log starts here, or after a RESET) it only opens one. A step
        whose phases were not timed (`timed` False: UNTIMED_END) keeps its wall time only."""
        if self._t0 == 0:
            self._open(now)
            self.partial = False
            return
        if self._cur >= 0:  # a phase spans the boundary: split it
            self._acc[self._cur] += now - self._cur_t
            self._cur_t = now
        device_ms = None
        if self._events is not None and end_ms is not None:  # an eval cut has no end event
            self._events[0] = (-1, self._events[0][1], end_ms)
            device_ms = phase_ms(self._events)
        if self._eval_fwd and not self._has_train and timed:  # UNTIMED_END: a training step's end
            kind = "eval"
        if self.by_backward and kind == "train":
            self._extras()["at_backward"] = True
        if self._acc[CHECKPOINT]:  # a save's time, kept on an untimed step too
            self._extras()["saved_ns"] = self._acc[CHECKPOINT]
        extra = self._extra if self._extra is not None else {}
        if self.partial:  # its start was not seen: its times would be wrong
            self.partial = False
        else:
            acc = tuple(self._acc) if timed and not self._untimed else None
            self.out.append((self.index, kind, self._t0, now - self._t0, acc, self._micro, device_ms, extra))
        self._prev_extra, self._fresh = extra, True
        self.index += 1
        self._acc = [0] * N_PHASES
        self._opt_base = 0
        self._micro = 0
        self._has_train = self._eval_fwd = self._untimed = self._split = False
        self._extra = None
        self._group = None
        self._open(now)

    @property
    def fresh(self) -> bool:
        """Nothing happened since the last step ended (its extras may still come)."""
        return self._fresh

    def reset(self) -> None:
        """Forget the open step (entries were lost, or an entry was malformed)."""
        self.partial = True
        self._t0 = 0
        self._cur = -1
        self._stack.clear()
        self._paused.clear()
        self._acc = [0] * N_PHASES
        self._opt_base = 0
        self._micro = 0
        self._events = None
        self._has_train = self._eval_fwd = self._untimed = self._split = False
        self._extra = None
