"""Captures across a job's ranks: the same steps on every rank, and which trace shows the wait.

`p` in the job view asks every running rank for a profile of the same N steps: it names the step
to start at (`at_step`), a little past the furthest rank, so the request reaches every rank
first. Each rank's agent writes its own trace, named by its rank. When all are done, the summary
says which rank's trace shows the collective wait and which shows the straggler's own phase,
from torchtop's own figures for exactly those steps. Pure: no textual, no zmq.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torchtop.contract.capture import CAPTURE_ACTIVE as ACTIVE
from torchtop.contract.capture import CAPTURE_FINISHED as FINISHED
from torchtop.contract.capture import CaptureInfo, CaptureState
from torchtop.monitor.model.captures import CaptureBook
from torchtop.monitor.model.job_state import JobState
from torchtop.monitor.model.state import step_stats

LEAD_S = 1.0  # the request reaches every rank well within this (tunnels included)
LEAD_STEPS = 3


@dataclass
class Round:
    """One request to several ranks for the same steps."""

    kind: str
    at_step: int
    steps: int
    keys: list[str]
    ids: dict[str, int] = field(default_factory=dict[str, int])  # member -> its capture id
    announced: bool = False


def start_step(job: JobState) -> int:
    """The step every running rank has yet to start: past the furthest by ~LEAD_S of steps."""
    live = job.live()
    furthest = max((m.last_i for m in live), default=0)
    rates = [step_stats(list(m.state.steps)[-200:])["steps_per_s"] for m in live if m.state.steps]
    rates += [m.stats.window(10).steps / 10 for m in live if m.via]  # relayed: no steps, buckets
    rate = max(rates, default=0.0)
    return furthest + 1 + LEAD_STEPS + math.ceil(rate * LEAD_S)


class JobCaptures:
    """Every member's captures, and the rounds asked of several ranks."""

    def __init__(self) -> None:
        self.books: dict[str, CaptureBook] = {}
        self.round: Round | None = None

    def book(self, key: str) -> CaptureBook:
        return self.books.setdefault(key, CaptureBook())

    def ask(self, kind: str, at_step: int, steps: int, keys: list[str]) -> None:
        self.round = Round(kind, at_step, steps, keys)

    def requested(self, key: str, capture: CaptureInfo | None) -> None:
        self.book(key).requested(capture)
        r = self.round
        if capture is not None and r is not None and key in r.keys:
            r.ids[key] = capture.id

    def captures(self, key: str) -> list[CaptureInfo]:
        r = self.round
        book = self.books.get(key)
        if r is None or book is None or key not in r.ids:
            return []
        c = book.by_id.get(r.ids[key])
        return [c] if c is not None else []

    def state(self) -> tuple[int, int, int]:
        """(active, done, failed) captures of the current round."""
        r = self.round
        if r is None:
            return 0, 0, 0
        got = [c for k in r.keys for c in self.captures(k)]
        return (
            sum(c.state in ACTIVE for c in got) + len(r.keys) - len(got),
            sum(c.state == CaptureState.DONE for c in got),
            sum(c.state == CaptureState.FAILED for c in got),
        )

    def finished(self) -> bool:
        r = self.round
        if r is None or not r.keys:
            return False
        return all(any(c.state in FINISHED for c in self.captures(k)) for k in r.keys)

    def current(self) -> CaptureInfo | None:
        """The capture to show on the capture line: one still running, else the latest."""
        every = [c for b in self.books.values() for c in b.by_id.values()]
        active = [c for c in every if c.state in ACTIVE]
        pool = active or every
        return max(pool, key=lambda c: c.requested_at) if pool else None

    def count(self) -> int:
        return sum(len(b.by_id) for b in self.books.values())


def round_summary(job: JobState, caps: JobCaptures) -> list[str]:
    """Once a round is done: each rank's trace, and which one shows the wait (torchtop's comm
    over exactly the captured steps) and which the slowest rank's own time."""
    r = caps.round
    if r is None:
        return []
    rows: list[tuple[int, CaptureInfo, float | None, float | None]] = []
    for key in r.keys:
        m = job.members.get(key)
        got = caps.captures(key)
        if m is None or not got:
            continue
        c = got[0]
        steps = [s for s in m.state.steps if r.at_step <= s.i < r.at_step + r.steps and s.phases]
        comm = sum(s.phases.get("comm", 0) for s in steps) / len(steps) / 1e6 if steps else None
        own = sum(s.wall_ns - s.phases.get("comm", 0) for s in steps) / len(steps) / 1e6 if steps else None
        rows.append((m.rank, c, comm, own))
    rows.sort(key=lambda x: x[0])
    lines = [
        f"rank {rank}: {c.path or c.error}" + ("" if c.state == CaptureState.DONE else f" ({c.state})")
        for rank, c, _, _ in rows
    ]
    measured = [(rank, comm, own) for rank, _, comm, own in rows if comm is not None and own is not None]
    if len(measured) >= 2:
        waits = max(measured, key=lambda x: x[1])
        late = max(measured, key=lambda x: x[2])
        lines.insert(
            0,
            f"steps #{r.at_step}-#{r.at_step + r.steps - 1} on {len(rows)} ranks: rank {waits[0]}'s trace shows "
            f"the collective wait ({waits[1]:.1f} ms a step); rank {late[0]}'s shows the most time of its "
            f"own ({late[2]:.1f} ms a step): what the others wait for",
        )
    return lines
