"""The training thread's side: a timestamp and a code per event, appended to a flat log.

This is all the work the training thread does for torchtop: `perf_counter_ns()`, a shift, one
`list.append` of an int (ints are not tracked by the garbage collector), and on sampled steps
a CUDA `Event.record()` from a pool. Everything else (nesting phases, cutting steps, telling
training from evaluation) is done by the monitor, which replays the log (monitor/replay.py);
the agent thread only ships it (publisher.py). Step ends are the one decision taken here,
because captures and CUDA sampling must act on the training thread at step boundaries.

An entry is `perf_counter_ns() << SHIFT | code`, or a tuple whose first item is that int
(a CUDA event, h2d bytes, a user mark). The log is bounded: when the agent thread stops
draining it, the oldest half goes (counted), and a RESET entry tells the replay.
"""

from __future__ import annotations

import threading
from time import perf_counter_ns
from typing import Any

from .wire import (  # the log's format is the wire's: the agent ships it as written
    BOUNDARY,
    EXIT,
    FORWARD_START,
    H2D_COPY,
    MARK,
    OPEN_STEP,
    RESET,
    SHIFT,
    STEP_EVENT,
    code_of,
)

LOG_CAP = 1 << 18  # entries (~10 a step): a stalled agent thread costs at most ~10 MB
MAX_FAILURES = 20


class Probe:
    """What the hooks call on the training thread. `tid` is that thread (0: switched off).

    `put(stamp)` appends one entry; on a step sampled for CUDA timing it is swapped for a
    method that records an event with each entry, so the wrappers never test for sampling.
    """

    __slots__ = (
        "tid", "active", "log", "put", "_append", "lock", "steps", "explicit", "on_step", "failures",
        "dropped", "pool", "sample_every", "sampled", "_stream", "_record_ns", "cuda_marks",
    )

    def __init__(self, thread_id: int | None = None) -> None:
        self.tid = thread_id if thread_id is not None else threading.get_ident()
        self.active = True
        self.log: list[Any] = []  # never replaced: the agent thread takes a prefix (drain)
        self._append = self.log.append
        self.put = self._append
        self.lock = threading.Lock()  # drain vs shedding the oldest entries
        self.steps = 0  # training steps cut here
        self.explicit = False  # step() was used: the hooks stop cutting steps
        self.on_step: Any = None  # set while a capture is armed: called at each boundary
        self.failures = 0
        self.dropped = 0  # steps lost to the log's bound
        # CUDA sampling, driven by the agent thread: `pool` stays None off CUDA
        self.pool: Any = None
        self.sample_every = 0
        self.sampled = False
        self._stream: Any = None
        self._record_ns = 0
        self.cuda_marks = False  # a mark holds a CUDA event: the agent must resolve it

    # -- failure policy ------------------------------------------------------------------------
    def fail(self) -> None:
        self.failures += 1
        if self.failures >= MAX_FAILURES:
            self.disable()

    def disable(self) -> None:
        """No more entries: every wrapper passes straight through (stop, fork, failures)."""
        self.active = False
        self.tid = 0  # no thread has ident 0
        self.on_step = None

    def on_thread(self) -> bool:
        return threading.get_ident() == self.tid

    # -- entries -------------------------------------------------------------------------------
    def stamp(self, code: int) -> None:
        """An entry with no payload; phases go through `put` (and get events when sampled)."""
        self._append(perf_counter_ns() << SHIFT | code)

    def enter(self, phase: int) -> None:
        self.put(perf_counter_ns() << SHIFT | phase)

    def exit(self, phase: int) -> None:
        self.put(perf_counter_ns() << SHIFT | EXIT | phase)

    def forward(self, slot: int, grad: bool) -> None:
        self.put(perf_counter_ns() << SHIFT | FORWARD_START + 2 * slot + grad)

    def open_step(self) -> None:
        """`with step():` entered."""
        self.explicit = True
        self._append(perf_counter_ns() << SHIFT | OPEN_STEP)

    def mark(self, name: str, value: Any) -> None:
        self._append((perf_counter_ns() << SHIFT | MARK, name, value))

    def h2d(self, start_ns: int, dt_ns: int, nbytes: int, pinned: bool, ev0: Any, ev1: Any) -> None:
        self._append((start_ns << SHIFT | H2D_COPY, dt_ns, nbytes, pinned, ev0, ev1))

    # -- CUDA events ---------------------------------------------------------------------------
    def record(self) -> Any:
        """A pooled event recorded now on this step's stream (None if the pool ran dry)."""
        t = perf_counter_ns()
        ev = self.pool.take()
        if ev is not None:
            ev.record(self._stream)  # looked up once a step: current_stream() costs ~4 us
        self._record_ns += perf_counter_ns() - t
        return ev

    def _put_event(self, entry: int) -> None:
        self._append((entry, self.record()))

    # -- step boundaries -----------------------------------------------------------------------
    def cut(self) -> None:
        """A training step ends now: log it, decide whether the next is sampled, run a capture."""
        try:
            if self.sampled:
                end = self.record()
                self._append((perf_counter_ns() << SHIFT | BOUNDARY, end, self._record_ns))
            else:
                self._append(perf_counter_ns() << SHIFT | BOUNDARY)
            self.steps += 1
            every = self.sample_every
            if self.pool is not None and every > 0 and self.steps % every == 0:
                self._stream = self.pool.current_stream()
                self._record_ns = 0
                self.sampled = True
                self.put = self._put_event
                self._append((perf_counter_ns() << SHIFT | STEP_EVENT, self.record()))
            elif self.sampled:
                self.sampled = False
                self.put = self._append
            if len(self.log) > LOG_CAP:
                self._shed()
        except Exception:
            self.fail()
        if self.on_step is not None:
            try:
                self.on_step()
            except Exception:
                self.on_step = None

    def _shed(self) -> None:
        """The agent thread is not draining: drop the oldest half, count its steps, say so.

        The cut falls on a step boundary, which stays (after RESET) to open the steps kept."""
        log = self.log
        with self.lock:
            n = len(log) // 2
            while n > 1 and code_of(log[n - 1]) != BOUNDARY:
                n -= 1
            if n <= 1:
                n = len(log) // 2 + 1
            lost = log[:n]  # the step the kept boundary closes is lost too
            del log[: n - 1]
            log.insert(0, RESET)
        # an opening boundary kept by an earlier shed closed a step counted then
        counted = lost[0] == RESET and len(lost) > 1 and code_of(lost[1]) == BOUNDARY
        self.dropped += sum(1 for e in lost if code_of(e) == BOUNDARY) - counted

    def drain(self) -> tuple[list[Any], int]:
        """Agent thread: everything logged so far, oldest first, and the steps cut so far."""
        log = self.log
        with self.lock:
            n = len(log)
            out = log[:n]
            del log[:n]
            steps = self.steps
        return out, steps
