"""Ranks read through their node's relay, and the job's coverage: how many ranks report.

A relay's NodeSummary (wire.py) carries each rank's 1-second buckets since its previous one; they
go into the rank's RankStats as they would from its steps, so the Ranks tab, the strip and the
straggler rule read relayed and directly connected ranks alike. A relayed rank has no steps of its
own here (until someone drills into it). Coverage counts the ranks that report now against the
job's world size and names the nodes that went silent, and for how long. Pure: no zmq, no textual.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from torchtop.contract.wire import NodeSummary
from torchtop.monitor.model.state import STALE_AFTER_S

if TYPE_CHECKING:
    from torchtop.monitor.model.job_state import JobState, Member

SILENT_AFTER_S = 3.0  # a relay with no summary this long: its node's ranks are not reporting
NOT_REPORTING = "not reporting"


@dataclass
class RelayState:
    node: str
    seq: int = -1
    last_at: float | None = None  # the monitor's clock at its last summary
    summaries: int = 0
    gaps: int = 0  # summaries lost on the way (sequence numbers skipped)
    received: int = 0  # batches the relay received from its ranks (its own count)
    error: str = ""  # why it is not reached ("" while fine)

    def silent_for(self, now: float) -> float | None:
        """Seconds since its last summary when that is more than SILENT_AFTER_S, else None."""
        if self.last_at is None:
            return None
        quiet = now - self.last_at
        return quiet if quiet > SILENT_AFTER_S else None


def member_key(relay: str, rank: int) -> str:
    return f"{relay}/rank{rank}"


def apply_summary(job: JobState, relay: str, s: NodeSummary, now: float) -> None:
    """One relay's summary into the job: its ranks' hellos, buckets, liveness and samples."""
    if job.job_id and s.job_id != job.job_id:
        job.note(f"the relay on {s.node} serves job {s.job_id}, not {job.job_id}: not shown")
        return
    state = job.relays.get(relay)
    if state is None:
        state = job.relays[relay] = RelayState(s.node)
    if state.seq >= 0 and s.seq > state.seq + 1:
        state.gaps += s.seq - state.seq - 1
    state.node, state.seq, state.last_at, state.received = s.node, s.seq, now, s.received
    state.summaries += 1
    state.error = ""
    for rs in s.ranks:
        key = member_key(relay, rs.rank)
        m = job.member(key)
        m.via, m.via_node = relay, s.node
        if rs.hello is not None and not job.apply_hello(key, rs.hello):
            continue
        if m.hello is None or m.refused:
            continue  # its hello comes with the next summaries
        st = m.state
        for b in rs.buckets:
            if len(b) > 1:
                m.stats.put(int(b[0]), b[1:])
        if rs.age >= 0:
            st.last_batch_at = now - rs.age
        st.gone = rs.gone
        st.batches = rs.batches
        if rs.telemetry is not None:
            st.apply_telemetry(rs.telemetry)
        m.last_i = max(m.last_i, rs.last_i)


def relay_status(job: JobState, m: Member, now: float) -> str | None:
    """ "not reporting" for a rank whose relay went silent, or whose figures went stale more
    through its relay's silence than through its own; None otherwise."""
    if not m.via:
        return None
    state = job.relays.get(m.via)
    if state is None:
        return None
    if state.silent_for(now) is not None or state.error:
        return NOT_REPORTING
    last = m.state.last_batch_at
    if state.last_at is None or last is None or now - last <= STALE_AFTER_S:
        return None
    # a rank's age is the relay's word plus the relay's quiet since: the longer of the two is why
    return NOT_REPORTING if now - state.last_at >= state.last_at - last else None


class Coverage(NamedTuple):
    reporting: int  # ranks whose figures are current
    expected: int  # the job's world size (or the ranks seen, if more)
    silent: list[tuple[str, float]]  # nodes none of whose ranks report: (node, seconds silent)
    unreached: list[str]  # relays (nodes) that never answered: their errors


def coverage(job: JobState, now: float) -> Coverage:
    from torchtop.monitor.model.state import Link

    ranked = job.ranked()
    expected = max([m.hello.world_size for m in ranked if m.hello] + [len(ranked)])
    by_node: dict[str, list[Member]] = {}
    reporting = 0
    for m in ranked:
        ok = m.state.link(now) == Link.CONNECTED and relay_status(job, m, now) is None
        reporting += ok
        by_node.setdefault(m.node, []).append(m)
    silent: list[tuple[str, float]] = []
    for node, members in by_node.items():
        if any(m.state.link(now) == Link.CONNECTED and relay_status(job, m, now) is None for m in members):
            continue
        heard = [m.state.last_batch_at for m in members if m.state.last_batch_at is not None]
        relays = [r.last_at for r in job.relays.values() if r.node == node and r.last_at is not None]
        last = max(heard + relays, default=None)
        silent.append((node, now - last if last is not None else -1.0))
    unreached = [f"{r.node}: {r.error}" for r in job.relays.values() if r.error and r.last_at is None]
    return Coverage(reporting, expected, sorted(silent, key=lambda x: -x[1]), unreached)


def coverage_line(c: Coverage, most: int = 3) -> str:
    """1,019 of 1,024 ranks reporting; node 17 silent 40 s"""
    line = f"{c.reporting:,} of {c.expected:,} ranks reporting"
    parts = [f"{node} silent {s:.0f} s" if s >= 0 else f"{node} silent" for node, s in c.silent[:most]]
    if len(c.silent) > most:
        parts.append(f"{len(c.silent) - most} more nodes silent")
    return "; ".join([line, *parts])
