"""The probe log's other end: the agent thread takes whole pairs from its front (`drain`), and
the training thread drops the oldest half when the agent thread has not drained it for long
(`_shed`, from `Probe.housekeep`). A base of `Probe` (hooks/probe.py), which holds the state."""

from __future__ import annotations

import threading

from torchtop.contract.logcodes import (
    RESET,
    STEP_ENDS,
    Item,
    code_of,
    count_step_ends,
    to_entries,
)


class LogDrain:
    """`Probe`'s log-draining and shedding methods; the fields are the probe's (its __slots__)."""

    __slots__ = ()
    log: list[Item]
    lock: threading.Lock
    tail: list[Item]
    dropped: int
    _drained: int
    _shed_cuts: int

    def _shed(self) -> None:
        """The agent thread is not draining: drop the oldest half, count its steps, say so.

        The cut falls after a step end, which stays (after RESET) to open the steps kept."""
        log = self.log
        with self.lock:
            half = len(log) // 2 & ~1
            n = half  # items: the pair ending at n - 1 is the step end kept
            while n > 2 and code_of(log[n - 1]) not in STEP_ENDS:
                n -= 2
            kept_cut = n > 2
            if not kept_cut:
                n = half + 2
            lost = log[:n]  # the step the kept boundary closes is lost too
            del log[: n - 2]
            log[0:0] = [0, RESET]
            codes = [code_of(c) for c in lost[1::2]]
            cuts = sum(c in STEP_ENDS for c in codes)
            # an opening boundary kept by an earlier shed closed a step counted then
            counted = codes[0] == RESET and len(codes) > 1 and codes[1] in STEP_ENDS
            self.dropped += cuts - counted
            self._shed_cuts += cuts - kept_cut  # the agent thread will not see these end

    def _take(self) -> list[Item]:
        """Agent thread: the log's whole pairs so far, oldest first; counts the shed step ends."""
        log = self.log
        with self.lock:
            n = len(log) & ~1  # a pair the training thread is half-way through stays
            raw = log[:n]
            del log[:n]
            if n:
                self.tail = raw[-8:]
            self._drained += self._shed_cuts
            self._shed_cuts = 0
        return raw

    def drain_pairs(self) -> tuple[list[Item], int]:
        """Agent thread, a run without CUDA sampling: the log as it was written (pairs), and the
        steps cut so far (drained and shed). A CPU run ships this as is. (An event step's end
        is a tuple, which only `drain` counts.)"""
        raw = self._take()
        codes = raw[1::2]
        self._drained += count_step_ends(codes)
        return raw, self._drained

    def drain(self) -> tuple[list[Item], int]:
        """The log as wire entries (for the CUDA event resolver, which works on those), and the
        steps cut so far."""
        entries, cuts = to_entries(self._take())
        self._drained += cuts
        return entries, self._drained
