"""A job of many ranks as one thing: every rank's RunState side by side, and the job's own steps.

Each member is one agent (one rank), keyed by the endpoint it is reached at. Its RunState is
what the existing panels show when that rank is in focus; its RankStats (rank_stats.py) are what
the Ranks panel and the job rules read. The job's aggregate (`job.job`, a RunState too) holds one
step per step index, made when every rank still running has reported that step: the mean of the
ranks' times (phases over the ranks that timed it), so the existing panels and `diagnose` read
the job as they read one rank. An agent whose hello names another job is refused, never mixed;
agents of different torchtop versions are noted. Pure: no textual, no zmq.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from torchtop.contract.logcodes import PHASES
from torchtop.contract.wire import Batch, Hello, StepTally
from torchtop.monitor.model.rank_stats import DEVICE_KEYS, RankStats
from torchtop.monitor.model.relayed import RelayState
from torchtop.monitor.model.state import RunState
from torchtop.monitor.model.steps import StepRecord

MEMBER_HISTORY = 2_000  # steps kept per rank when the job has many (the 10 s window at 200 steps/s)
LAG_STEPS = 200  # a job step waits at most this many steps for a rank that is behind or silent
JOB_RANK = -1  # the rank of the aggregate's steps


@dataclass
class Member:
    """One agent of the job."""

    key: str  # the endpoint's label: unique per agent
    state: RunState
    stats: RankStats = field(default_factory=RankStats)
    error: str = ""  # why it is not connected, or was refused (one line)
    refused: bool = False  # another job's agent: shown as refused, never counted
    last_i: int = -1  # the highest train step index it reported
    via: str = ""  # the relay it is read through ("": its own connection)
    via_node: str = ""  # that relay's node name

    @property
    def hello(self) -> Hello | None:
        return self.state.hello

    @property
    def rank(self) -> int:
        return self.state.hello.rank if self.state.hello is not None else -1

    @property
    def node(self) -> str:
        if self.via_node:
            return self.via_node
        return self.state.hello.host if self.state.hello is not None else ""


class JobState:
    """Every rank of one job. `job_id` "" takes the first hello's job id."""

    def __init__(self, job_id: str = "", member_history: int = MEMBER_HISTORY) -> None:
        self.job_id = job_id
        self.member_history = member_history
        self.members: dict[str, Member] = {}
        self.job = RunState()  # the aggregate
        self.notes: list[str] = []  # one-liners: nodes that failed, agents refused
        self.relays: dict[str, RelayState] = {}  # the nodes read through a relay (relayed.py)
        self.world = 0  # the largest world size a rank's hello gave (0: none yet)
        self._pending: dict[int, list[StepRecord]] = {}
        self._max_i = -1
        self._made = -1  # job steps up to this index are made: a rank's late record stays its own
        self._ranked: list[Member] | None = None  # ranked()'s, until a member, a rank or a refusal changes

    # -- members -------------------------------------------------------------------------------
    def member(self, key: str) -> Member:
        found = self.members.get(key)
        if found is None:
            state = RunState()
            state.steps = deque(maxlen=self.member_history)
            found = self.members[key] = Member(key, state)
            self._ranked = None
        return found

    def note(self, line: str) -> None:
        if line not in self.notes:
            self.notes.append(line)

    def live(self) -> list[Member]:
        """Members that are (or were) connected and not refused or gone."""
        return [
            m for m in self.members.values() if m.hello is not None and not m.refused and not m.state.gone
        ]

    def ranked(self) -> list[Member]:
        """Every member that said hello and was not refused, by rank (kept between changes: the
        job view reads it several times a refresh, a sort of 1,024 members each)."""
        if self._ranked is None:
            self._ranked = sorted(
                (m for m in self.members.values() if m.hello is not None and not m.refused),
                key=lambda m: (m.rank, m.key),
            )
        return list(self._ranked)

    def versions(self) -> dict[str, list[int]]:
        """torchtop version -> the ranks running it (more than one key: say so)."""
        out: dict[str, list[int]] = {}
        for m in self.ranked():
            out.setdefault(m.hello.agent_version or "?", []).append(m.rank)  # type: ignore[union-attr]
        return out

    def _same_rank(self, m: Member, hello: Hello) -> None:
        """Two agents that claim one rank of the job: one of them is not what its discovery
        file says (another process's file, or a stale one); both are shown, and this says so."""
        for other in self.members.values():
            h = other.hello
            if other is m or other.refused or h is None or h.rank != hello.rank:
                continue
            if (h.pid, h.host, h.run_id) == (hello.pid, hello.host, hello.run_id):
                who = f"{other.key} and {m.key} reach the same agent (pid {hello.pid} on {hello.host})"
            else:
                who = f"pid {h.pid} on {h.host} and pid {hello.pid} on {hello.host}"
            self.note(f"two agents claim rank {hello.rank}: {who}; a foreign or stale discovery file?")

    def share_telemetry(self) -> int | None:
        """The aggregate's memory, GPU and host samples are the rank using the most memory's (the
        Host tab shows that rank's, and the job's verdict reads its workers from the same sample):
        that rank, None when no rank has sent telemetry."""
        ranked = [m for m in self.ranked() if m.state.telemetry is not None]
        if not ranked:
            return None

        def used(m: Member) -> int:
            tel = m.state.telemetry
            if tel is None:
                return 0
            if tel.memory:
                return tel.memory[0].reserved
            return tel.host.proc_rss if tel.host is not None else 0

        top = max(ranked, key=used)
        agg = self.job
        agg.telemetry, agg.points, agg.peak_window = (
            top.state.telemetry,
            top.state.points,
            top.state.peak_window,
        )
        return top.rank

    # -- feeding -------------------------------------------------------------------------------
    def apply_hello(self, key: str, hello: Hello) -> bool:
        """A member's hello; False (and the member refused) when it belongs to another job."""
        m = self.member(key)
        if not self.job_id and hello.job_id:
            self.job_id = hello.job_id
        if self.job_id and hello.job_id != self.job_id:
            self._ranked = None if not m.refused else self._ranked
            m.refused = True
            m.error = f"rank {hello.rank} (pid {hello.pid} on {hello.host}) is in job {hello.job_id or '(none)'}, not {self.job_id}: not shown"
            self.note(m.error)
            return False
        before = m.hello
        if m.refused or before is None or before.rank != hello.rank:
            self._ranked = None  # joins the ranked, or moves among them
        m.refused, m.error = False, ""
        self.world = max(self.world, hello.world_size)
        m.state.apply_hello(hello)
        # a relay repeats each rank's hello with its summaries: the scan (every member) runs once
        # per agent, not at every summary (it was 6% of a core at 1,024 ranks)
        if before is None or (before.rank, before.pid, before.host, before.run_id) != (
            hello.rank,
            hello.pid,
            hello.host,
            hello.run_id,
        ):
            self._same_rank(m, hello)
        m.state.gone = False
        if self.job.hello is None or hello.rank == 0:
            self.job.hello = hello  # the device, torch and host of the job's header
        return True

    def apply_snapshot(
        self,
        key: str,
        steps: list[StepRecord],
        seq: int,
        tally: StepTally | None = None,
        wall_offset: float = 0.0,
    ) -> None:
        m = self.member(key)
        if m.refused:
            return
        m.state.apply_snapshot(steps, seq, tally, wall_offset)
        self._take(m, steps)

    def apply_batch(
        self,
        key: str,
        batch: Batch,
        steps: list[StepRecord],
        now: float,
        log_errors: int = 0,
        finish: bool = True,
    ) -> None:
        """A member's batch. `finish` False leaves making the job's steps to `finish()` (a caller
        applying many batches at once calls it once)."""
        m = self.member(key)
        if m.refused:
            return
        steps = m.state.apply_batch(batch, steps, now, log_errors)  # a stall's phases estimated
        self._take(m, steps, finish)
        self.job.agent_time = max(self.job.agent_time, batch.time)
        self.job.last_batch_at = now
        self.job.batches += 1

    def lost(self, key: str, error: str) -> None:
        """The member stopped answering after it had answered: shown as gone; its steps stay."""
        m = self.member(key)
        m.error = error
        if m.hello is not None:
            m.state.gone = True
        self._finish()

    # -- the aggregate -------------------------------------------------------------------------
    def _take(self, m: Member, steps: list[StepRecord], finish: bool = True) -> None:
        fresh = [s for s in steps if s.kind == "train" and s.t0 > m.stats.last_t0]
        if not fresh:
            return
        m.stats.add(fresh)
        pending, made = self._pending, self._made
        for s in fresh:
            if s.i > made:
                pending.setdefault(s.i, []).append(s)
        m.last_i = max(m.last_i, fresh[-1].i)
        self._max_i = max(self._max_i, m.last_i)
        if finish:
            self.finish()

    def finish(self) -> None:
        """Make the job steps every live rank has reported (or that waited LAG_STEPS)."""
        if not self._pending:
            return
        upto = min((m.last_i for m in self.live()), default=self._max_i)
        upto = max(upto, self._max_i - LAG_STEPS)
        ready = sorted(k for k in self._pending if k <= upto)
        made = [job_step(i, self._pending.pop(i)) for i in ready]
        if made:
            self.job.steps.extend(made)
            self.job.tally.add(made)  # the aggregate counts its steps as a rank's state does
            self._made = max(self._made, ready[-1])

    _finish = finish


def job_step(i: int, ranks: list[StepRecord]) -> StepRecord:
    """One job step from the ranks' records of step `i`: mean wall and phases (over the ranks
    that timed it), mean device times (over the ranks that sampled it)."""
    timed = [s for s in ranks if s.phases]
    use = timed or ranks
    wall = sum(s.wall_ns for s in use) // len(use)
    phases: dict[str, int] = {}
    if timed:
        totals = [0] * len(PHASES)
        for s in timed:
            get = s.phases.get
            for k, p in enumerate(PHASES):
                totals[k] += get(p, 0)
        n = len(timed)
        phases = {p: t // n for p, t in zip(PHASES, totals)}
        phases["other"] = max(0, phases["other"] + wall - sum(phases.values()))  # rounding: they add up
    sampled = [s for s in ranks if s.device_ms]
    device = (
        {k: sum(s.device_ms.get(k, 0.0) for s in sampled) / len(sampled) for k in DEVICE_KEYS}
        if sampled
        else {}
    )
    t0 = min(s.t0 for s in ranks)
    micro = max(s.micro for s in use) if timed else 0
    return StepRecord(i, t0, wall, phases, "train", micro, device, JOB_RANK)
