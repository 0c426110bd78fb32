"""Ranks read through their node's relay, and the job's coverage: how many ranks report.

A relay's NodeSummary (wire.py) carries each rank's 1-second buckets since its previous one; they
go into the rank's RankStats as they would from its steps, so the Ranks tab, the strip and the
straggler rule read relayed and directly connected ranks alike. A relayed rank has no steps of its
own here (until someone drills into it). Coverage counts the ranks that report now against the
job's world size and names the nodes that went silent, and for how long. Pure: no zmq, no textual.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from torchtop.contract.relay import SECONDS_BACK, SUMMARY_VERSION, second_problem
from torchtop.contract.wire import NodeSummary, RankSummary
from torchtop.monitor.model.rank_stats import slots
from torchtop.monitor.model.state import STALE_AFTER_S

if TYPE_CHECKING:
    from torchtop.monitor.model.job_state import JobState, Member

SILENT_AFTER_S = 3.0  # a relay with no summary this long: its node's ranks are not reporting
NOT_REPORTING = "not reporting"
MAX_WORLD = 1 << 20  # ranks of a job, at most
MAX_NODE_RANKS = 1024  # ranks one relay may list: more is no node's
RELAYED_POINTS = 1_200  # telemetry points a relayed rank keeps (~10 min at 2 a second: every reader's span)
MAX_SKEW_S = 300.0  # a relay's clock this far from the monitor's: its seconds would hide every other rank's


@dataclass
class RelayState:
    node: str
    seq: int = -1
    last_at: float | None = None  # the monitor's clock at its last summary
    summaries: int = 0
    gaps: int = 0  # summaries lost on the way (sequence numbers skipped)
    received: int = 0  # batches the relay received from its ranks (its own count)
    error: str = ""  # why it is not reached ("" while fine)
    odd: int = 0  # figures it sent out of range, not taken (the first one is a note)

    def silent_for(self, now: float) -> float | None:
        """Seconds since its last summary when that is more than SILENT_AFTER_S, else None."""
        if self.last_at is None:
            return None
        quiet = now - self.last_at
        return quiet if quiet > SILENT_AFTER_S else None


def member_key(relay: str, rank: int) -> str:
    return f"{relay}/rank{rank}"


def apply_summary(job: JobState, relay: str, s: NodeSummary, now: float, wall: float | None = None) -> None:
    """One relay's summary into the job: its ranks' hellos, buckets, liveness and samples, each
    checked first (a relay is a peer: what is out of range is left out and said once). `wall`:
    this machine's clock, to refuse a relay's far from it."""
    if job.job_id and s.job_id != job.job_id:
        job.note(f"the relay on {s.node} serves job {s.job_id}, not {job.job_id}: not shown")
        return
    state = job.relays.get(relay)
    if state is None:
        state = job.relays[relay] = RelayState(s.node)
    if wall is not None and abs(s.time - wall) > MAX_SKEW_S:
        _odd(job, state, s.node, f"its clock is {s.time - wall:+.0f} s from this machine's")
        return
    if state.seq >= 0 and s.seq > state.seq + 1:
        state.gaps += s.seq - state.seq - 1
    state.node, state.seq, state.last_at, state.received = s.node, s.seq, now, s.received
    state.summaries += 1
    state.error = ""
    if s.summary_v > SUMMARY_VERSION:
        job.note(
            f"the relay on {s.node} sends summary version {s.summary_v}, this monitor reads "
            f"{SUMMARY_VERSION}: the figures it added are not shown"
        )
    for line in s.duplicates[:4]:
        job.note(f"the relay on {s.node}: two agents claim {line[:80]}; a foreign or stale discovery file?")
    for rs in _ranks(job, relay, state, s):
        key = member_key(relay, rs.rank)
        m = job.member(key)
        m.via, m.via_node = relay, s.node
        if rs.hello is not None and not job.apply_hello(key, rs.hello):
            continue
        if m.hello is None or m.refused:
            continue  # its hello comes with the next summaries
        st = m.state
        for b in rs.buckets:
            why = second_problem(b, s.time)
            if why is None:
                m.stats.put(int(b.t), slots(b))
            else:
                _odd(job, state, s.node, f"rank {rs.rank}: {why}")
        if rs.age >= 0:
            st.last_batch_at = now - rs.age
        st.gone = rs.gone
        st.batches = rs.batches
        if rs.telemetry is not None:
            if st.points.maxlen != RELAYED_POINTS:  # 1,024 ranks x 20,000 points is gigabytes in hours
                st.points = deque(st.points, maxlen=RELAYED_POINTS)
            st.apply_telemetry(rs.telemetry)
        m.last_i = max(m.last_i, rs.last_i)


def _odd(job: JobState, state: RelayState, node: str, why: str) -> None:
    state.odd += 1
    if state.odd == 1:
        job.note(f"the relay on {node} sent figures out of range, left out ({why[:160]})")


def _rank_problem(rs: RankSummary, world: int) -> str | None:
    if not 0 <= rs.rank < (world or MAX_WORLD):
        return f"rank {rs.rank} outside the job's {world or MAX_WORLD:,} ranks"
    h = rs.hello
    if h is not None and (h.rank != rs.rank or not 0 < h.world_size <= MAX_WORLD or rs.rank >= h.world_size):
        return f"rank {rs.rank} with the hello of rank {h.rank} of {h.world_size}"
    if rs.age < 0 and rs.age != -1.0 or min(rs.batches, rs.steps, rs.last_i + 1, rs.seq + 1) < 0:
        return f"rank {rs.rank}: a count below 0"
    if len(rs.buckets) > SECONDS_BACK + 1:
        return f"rank {rs.rank}: {len(rs.buckets)} seconds in one summary"
    return None


def _ranks(job: JobState, relay: str, state: RelayState, s: NodeSummary) -> list[RankSummary]:
    """The summary's ranks that are within the job, one per rank: of two that claim one (a
    foreign or stale agent on the node), the one this rank was, else the live one; never the
    gone one over the live."""
    if len(s.ranks) > MAX_NODE_RANKS:
        _odd(job, state, s.node, f"{len(s.ranks):,} ranks on one node")
    told = [rs.hello.world_size for rs in s.ranks[:MAX_NODE_RANKS] if rs.hello is not None]
    world = min(max([job.world, *told]), MAX_WORLD)  # the job's size, as its ranks' hellos give it
    chosen: dict[int, RankSummary] = {}
    for rs in s.ranks[:MAX_NODE_RANKS]:
        why = _rank_problem(rs, world)
        if why is not None:
            _odd(job, state, s.node, why)
            continue
        have = chosen.get(rs.rank)
        if have is None:
            chosen[rs.rank] = rs
            continue
        job.note(
            f"the relay on {s.node} lists rank {rs.rank} twice (runs {have.run_id[:40]} and "
            f"{rs.run_id[:40]}): a foreign or stale agent? the live one is shown"
        )
        m = job.members.get(member_key(relay, rs.rank))
        run = m.hello.run_id if m is not None and m.hello is not None else None

        if _standing(rs, run) > _standing(have, run):
            chosen[rs.rank] = rs
    return list(chosen.values())


def _standing(x: RankSummary, run: str | None) -> tuple[bool, bool, float]:
    """Live first, then the run this rank was, then the freshest."""
    return (not x.gone, x.run_id == run, -x.age if x.age >= 0 else float("-inf"))


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
    never: list[str]  # those relays' names, for the line


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
    never = [r for r in job.relays.values() if r.error and r.last_at is None]
    unreached = [f"{r.node}: {r.error}" for r in never]
    return Coverage(
        reporting, expected, sorted(silent, key=lambda x: -x[1]), unreached, [r.node for r in never]
    )


def coverage_line(c: Coverage, most: int = 3) -> str:
    """1,019 of 1,024 ranks reporting; node 17 silent 40 s; node 9 never answered"""
    line = f"{c.reporting:,} of {c.expected:,} ranks reporting"
    parts = [f"{node} silent {s:.0f} s" if s >= 0 else f"{node} silent" for node, s in c.silent[:most]]
    if len(c.silent) > most:
        parts.append(f"{len(c.silent) - most} more nodes silent")
    # a relay never heard from has no ranks here to count as silent: named, never dropped
    parts += [f"{node[:60]} never answered" for node in c.never[:most]]
    if len(c.never) > most:
        parts.append(f"{len(c.never) - most} more relays never answered")
    return "; ".join([line, *parts])
