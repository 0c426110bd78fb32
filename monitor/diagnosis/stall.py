"""A run that makes no step progress: for how long, and where its training thread is.

A run is stalled when no step has ended for `stall_steps` times its median step and at least
`stall_min_s` seconds of the agent's clock (its batches keep coming while the training thread is
blocked: the agent's threads send them). Where it is comes from the stack sampler's samples since
the last step ended: inside a collective (the collective wrappers' frames say `comm`: the sample's
phase, the collective's name its callee) or outside any (the user's innermost frame, and the call
it is blocked in). A job is stalled when every rank is: the ranks outside any collective hold
it, the others wait in theirs. A stall that ended is one step that long: "resumed" is said while
it is recent, with where it was. Pure: no textual, no zmq, no torch.

Where torch's flight recorder is on (the agent reads it while stalled: agent/telemetry/flight.py),
each rank's place in each process group names the collective by its sequence number: the ranks
that never entered a group's collective #N hold the job, the others wait in it ("ranks 0, 2 wait
in all_reduce #1841 since 14 s"), also where their stacks are elsewhere (an NCCL wait in `.item()`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from itertools import islice
from typing import TYPE_CHECKING

from torchtop.contract.logcodes import COMM, SAMPLE_CHECKPOINT
from torchtop.monitor.diagnosis.facts import THRESHOLDS as T
from torchtop.monitor.diagnosis.facts import Finding
from torchtop.monitor.model.fmt import ms
from torchtop.monitor.model.hotspots import short_callee, short_site

if TYPE_CHECKING:
    from torchtop.contract.telemetry import Collective
    from torchtop.contract.why import StackSample
    from torchtop.monitor.diagnosis.facts import Facts
    from torchtop.monitor.model.state import RunState
    from torchtop.monitor.model.steps import StepRecord

MEDIAN_STEPS = 50  # the run's pace: the median of its last this many training steps
MIN_STEPS = 3  # fewer steps seen: no pace to stall from (a first step may take minutes)
SCAN_STEPS = 20_000  # a resumed stall is looked for this far back at most (a refresh stays cheap)
DIST = "torch.distributed:"  # a collective wrapper's callee (agent/telemetry/stacks.py)
DEFAULT_GROUP = "default_pg"  # the default process group: not named in the words
COMPLETED = "completed"


@dataclass(frozen=True)
class Where:
    """Where the training thread is, read off its stack samples."""

    site: str  # the user's innermost frame, "path:line function" ("" none of the user's)
    callee: str  # what it is calling there ("module:qualname", or a name: "time.sleep"; "" unknown)
    collective: str  # inside this collective ("" outside any)
    since_s: float  # for this long, as far as the samples go
    saving: bool = False  # inside a checkpoint save (the agent's `checkpoint` phase): no hang

    def phrase(self) -> str:
        """ "in `time.sleep` at train.py:42 main" / "in all_reduce at train.py:57 main"."""
        at = f" at {short_site(self.site)}" if self.site else ""
        if self.collective:
            return f"in {self.collective}{at}"
        return (
            f"in `{short_callee(self.callee)}`{at}"
            if self.callee
            else (f"at {short_site(self.site)}" if at else "")
        )


@dataclass(frozen=True)
class Stall:
    """No step end for `silent_s` (going on), or one that ended at `ended` (a step that long)."""

    silent_s: float
    median_ms: float
    start: float  # wall clock: the last step's end before it
    where: Where | None  # None: no stack samples in it
    ended: float | None = None  # wall clock it resumed (None: still stalled)
    ago_s: float = 0.0  # a resumed one: how long ago it resumed
    world: int = 1  # the run's world size: "outside any collective" said where there are any


def limit_s(median_ms: float) -> float:
    """How long without a step end is a stall for a run of this median step."""
    return max(T.stall_min_s, T.stall_steps * median_ms / 1e3)


def _median_ms(steps: Sequence[StepRecord]) -> float | None:
    walls = sorted(
        [s.wall_ns for s in islice(reversed(steps), MEDIAN_STEPS * 2) if s.kind == "train"][:MEDIAN_STEPS]
    )
    return walls[len(walls) // 2] / 1e6 if len(walls) >= MIN_STEPS else None


def collective_of(s: StackSample) -> str:
    """The collective a sample sits in ("" outside any)."""
    if s.phase != COMM:
        return ""
    if s.callee.startswith(DIST):
        return s.callee[len(DIST) :]
    return "a collective"


def _key(s: StackSample) -> tuple[str, str]:
    return (s.site, collective_of(s))


def where_now(samples: Iterable[tuple[float, StackSample]], since: float, now: float) -> Where | None:
    """Where the newest samples after `since` have the thread, and since when: the stall's
    start where every sample in it has it there (a monitor that joined late sampled its end
    only), else the first of the newest run of samples there (`samples` newest first)."""
    newest: StackSample | None = None
    first = since
    for t, s in samples:
        if t < since:
            first = since  # every sample after the start has it here
            break
        if newest is None:
            newest = s
        elif _key(s) != _key(newest):
            break
        first = t
    else:
        first = since
    if newest is None:
        return None
    return Where(
        newest.site,
        newest.callee,
        collective_of(newest),
        max(0.0, now - first),
        newest.phase == SAMPLE_CHECKPOINT,
    )


def named(c: Collective) -> str:
    """ "all_reduce #1841" / "all_reduce #12 (group dp)"."""
    group = "" if c.group == DEFAULT_GROUP else f" (group {c.group})"
    return f"{c.op} #{c.seq}{group}"


def with_seq(where: Where | None, collectives: Sequence[Collective]) -> Where | None:
    """The stack's collective with its sequence number from the rank's own flight recorder: the
    oldest one not completed where the states are known (NCCL: the thread may wait for it outside
    any collective frame, in `.item()`), else the last entered of the stack's op (gloo)."""
    if where is None or not collectives:
        return where
    pending = [c for c in collectives if c.state and c.state != COMPLETED]
    if pending:
        c = max(pending, key=lambda c: c.age_s)
    elif not where.collective:
        return where
    else:
        same = [c for c in collectives if not c.state and c.op == where.collective]
        if not same:
            return where
        c = min(same, key=lambda c: c.age_s)
    return replace(where, collective=named(c))


def where_in(samples: Iterable[tuple[float, StackSample]], start: float, end: float) -> Where | None:
    """Where most samples between `start` and `end` had the thread (`samples` newest first)."""
    seen: Counter[tuple[str, str, str]] = Counter()
    for t, s in samples:
        if t < start:
            break
        if t <= end:
            seen[(s.site, s.callee, collective_of(s))] += 1
    if not seen:
        return None
    (site, callee, coll), _ = seen.most_common(1)[0]
    return Where(site, callee, coll, end - start)


def run_stall(state: RunState) -> Stall | None:
    """The run's stall going on, else the last one that ended within `stall_said_s`, else None."""
    steps = state.steps
    median = _median_ms(steps)
    if median is None or not state.agent_time:
        return None
    last = steps[-1]
    start = last.t0 + last.wall_ns / 1e9
    silent = state.agent_time - start
    limit = limit_s(median)
    world = state.hello.world_size if state.hello is not None else 1
    samples = reversed(state.why.samples)
    if silent >= limit:
        where = where_now(samples, start, state.agent_time)
        if state.telemetry is not None:
            where = with_seq(where, state.telemetry.collectives)
        return Stall(silent, median, start, where, world=world)
    for s in islice(reversed(steps), SCAN_STEPS):
        end = s.t0 + s.wall_ns / 1e9
        if state.agent_time - end > T.stall_said_s:
            break
        if s.kind == "train" and s.wall_ns / 1e9 >= limit and not state.why.excluded(s):
            where = where_in(samples, s.t0, end)
            return Stall(s.wall_ns / 1e9, median, s.t0, where, end, max(0.0, state.agent_time - end), world)
    return None


def rule_stalled(f: Facts, scale: float) -> Finding | None:
    """No step end for `stall_steps` x the median step and `stall_min_s`: critical, before any
    other verdict (the figures of the steps before it say nothing of what stops it now)."""
    s = f.stall
    if s is None or s.ended is not None:
        return None
    evidence = [f"no step end for {s.silent_s:.0f} s (the median step is {ms(s.median_ms)} ms)"]
    w = s.where
    if w is not None and w.saving:  # a long save is no hang: said as what it is, a warning
        evidence.append(f"the training thread is saving a checkpoint, {w.phrase()} (for {w.since_s:.0f} s)")
        advice = (
            "torch.distributed.checkpoint.async_save stages the state and writes it off the training thread",
            "save less often: the checkpoint verdict says what each interval costs once the save ends",
        )
        return Finding("stalled", "warning", 1.0, tuple(evidence), advice)
    if w is None:
        evidence.append("where the training thread is: unknown (no stack samples: TORCHTOP_STACK_HZ=0?)")
    elif w.collective:
        evidence.append(f"the training thread waits {w.phrase()} since {w.since_s:.0f} s")
    else:
        outside = ", outside any collective" if s.world > 1 else ""
        evidence.append(f"the training thread is {w.phrase()}{outside} (for {w.since_s:.0f} s)")
    advice = (
        "`py-spy dump --pid PID` prints its whole stack (with --native, the C++ frames under it)",
        "when it resumes, torchtop says so and keeps the stall's span in the recording",
    )
    return Finding("stalled", "critical", 1.0, tuple(evidence), advice)


def stall_upside(f: Facts) -> None:
    """Nothing a faster step buys while no step ends."""
    return None


def resumed_line(s: Stall, who: str = "the training thread") -> str:
    where = f" ({who} was {s.where.phrase()})" if s.where is not None and s.where.phrase() else ""
    return f"resumed {s.ago_s:.0f} s ago after a stall of {s.silent_s:.0f} s{where}"


def with_resumed(verdict: Finding, f: Facts) -> Finding:
    """A stall that ended recently, said under whatever the verdict is now."""
    s = f.stall
    if s is None or s.ended is None or verdict.kind == "stalled":
        return verdict
    return replace(verdict, evidence=(*verdict.evidence, resumed_line(s)))


# -- a job ---------------------------------------------------------------------------------------
def _ranks(ranks: Iterable[int]) -> str:
    got = sorted(ranks)
    return ("rank " if len(got) == 1 else "ranks ") + ", ".join(str(r) for r in got)


@dataclass(frozen=True)
class Arrival:
    """A process group's collective #seq from its ranks' flight recorders: who entered it (and
    waits) and who never did."""

    name: str  # "all_reduce #1841 (group dp)"
    waiting: tuple[int, ...]
    missing: tuple[int, ...]
    since_s: float  # the longest a waiting rank has been in it
    known: bool  # the states are real (NCCL's): a rank in it waits, whatever its stack says


def arrivals(states: dict[int, RunState]) -> list[Arrival]:
    """Per process group seen on two ranks or more: the collective it stopped at, the oldest not
    completed where the states are known, else the highest any rank entered (gloo's collectives
    block the caller: the ranks that entered it wait there)."""
    groups: dict[str, dict[int, Collective]] = {}
    for r, st in states.items():
        if st.telemetry is not None:
            for c in st.telemetry.collectives:
                groups.setdefault(c.group_id, {})[r] = c
    out: list[Arrival] = []
    for cs in groups.values():
        if len(cs) < 2:
            continue
        known = all(c.state for c in cs.values())
        pending = [c.seq for c in cs.values() if c.state != COMPLETED] if known else []
        if known and not pending:
            continue
        n = min(pending) if known else max(c.last_seq for c in cs.values())
        at = [c for c in cs.values() if c.seq == n]
        if not at:
            continue
        waiting = tuple(sorted(r for r, c in cs.items() if c.last_seq >= n))
        missing = tuple(sorted(r for r, c in cs.items() if c.last_seq < n))
        out.append(Arrival(named(at[0]), waiting, missing, max(c.age_s for c in at), known))
    return out


def job_stall(states: dict[int, RunState]) -> Finding | None:
    """Every rank stalled: the job is. Those outside any collective hold it (named first, with
    where they are); the others wait in their collectives."""
    stalls = {r: run_stall(st) for r, st in states.items() if _median_ms(st.steps) is not None}
    if not stalls or any(s is None or s.ended is not None for s in stalls.values()):
        return None
    now = {r: s for r, s in stalls.items() if s is not None}
    silent = min(s.silent_s for s in now.values())
    median = max(s.median_ms for s in now.values())
    evidence = [f"no step end on any rank for {silent:.0f} s (the median step is {ms(median)} ms)"]
    missing: dict[int, Arrival] = {}
    flown: dict[int, Arrival] = {}  # the ranks the flight recorder has waiting in a collective
    arrived = arrivals({r: states[r] for r in now})
    for a in arrived:
        for r in a.missing:
            missing.setdefault(r, a)
    for a in arrived:
        for r in a.waiting:
            w = now[r].where
            if r not in missing and (a.known or a.missing or (w is not None and w.collective)):
                flown.setdefault(r, a)
    outside = {r for r, s in now.items() if s.where is not None and not s.where.collective}
    holding = sorted(set(missing) | (outside - set(flown)))
    for r in holding:
        w = now[r].where
        if w is not None and not w.collective:
            evidence.append(f"rank {r} is {w.phrase()}, outside any collective (for {w.since_s:.0f} s)")
        else:
            it = f": it is {w.phrase()} (for {w.since_s:.0f} s)" if w is not None and w.phrase() else ""
            evidence.append(f"rank {r} never entered {missing[r].name}{it}")
    by_arrival: dict[int, list[int]] = {}
    for r, a in flown.items():
        by_arrival.setdefault(id(a), []).append(r)
    for a in arrived:
        rs = by_arrival.get(id(a))
        if rs:
            verb = "waits" if len(rs) == 1 else "wait"
            evidence.append(f"{_ranks(rs)} {verb} in {a.name} since {a.since_s:.0f} s")
    waiting: dict[str, list[int]] = {}
    for r, s in now.items():
        if s.where is not None and s.where.collective and r not in flown and r not in missing:
            waiting.setdefault(s.where.collective, []).append(r)
    for coll, rs in sorted(waiting.items(), key=lambda x: min(x[1])):
        since = max(now[r].where.since_s for r in rs if now[r].where is not None)  # type: ignore[union-attr]
        verb = "waits" if len(rs) == 1 else "wait"
        evidence.append(f"{_ranks(rs)} {verb} in {coll} since {since:.0f} s")
    unknown = sorted(r for r, s in now.items() if s.where is None and r not in flown and r not in missing)
    if unknown:
        evidence.append(f"{_ranks(unknown)}: where unknown (no stack samples)")
    if holding:
        advice = (
            f"{_ranks(holding)} {'holds' if len(holding) == 1 else 'hold'} the job: "
            "`py-spy dump --pid PID` there prints the whole stack",
        )
    else:
        advice = ("every rank waits in a collective: a mismatched call order or a lost peer",)
    return Finding("stalled", "critical", 1.0, tuple(evidence), advice)


def job_resumed(states: dict[int, RunState]) -> str | None:
    """The job's last stall that ended recently, in a line: the rank that held it by name."""
    ended = {r: s for r, st in states.items() if (s := run_stall(st)) is not None and s.ended is not None}
    if not ended:
        return None
    outside = [r for r, s in ended.items() if s.where is not None and not s.where.collective]
    r = min(outside) if outside else min(ended)
    return resumed_line(ended[r], f"rank {r}")


def with_job_resumed(verdict: Finding, states: dict[int, RunState]) -> Finding:
    """The job's verdict with its recent stall's line (the rank that held it named), in place of
    the aggregate's own (which cannot say where)."""
    line = job_resumed(states) if verdict.kind != "stalled" else None
    if line is None:
        return verdict
    kept = tuple(e for e in verdict.evidence if not e.startswith("resumed "))
    return replace(verdict, evidence=(*kept, line))
