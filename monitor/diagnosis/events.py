"""What changed, as events: the verdict in force (its kind or severity, after hysteresis), a stall
starting (`stalled`) and ending (`resumed`), a warning flag raised (the checkpoint verdict, an
out-of-memory forecast, a leak...). Pure: two diagnoses in, events out.

Events are derived from the diagnosis, never stored: the exporter keeps an EventLog per agent and
job across its refreshes (its counter `torchtop_events_total`), and a report rebuilds a window's
events by judging its steps again a second at a time, with the same hysteresis (a recording holds
what the monitor held, so its events are those the live view said). Kinds come from the
catalogue, plus `resumed`: the counter's labels stay bounded.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from torchtop.monitor.diagnosis.report_types import Event, EventRole
from torchtop.monitor.diagnosis.stall import run_stall

if TYPE_CHECKING:
    from torchtop.monitor.diagnosis.facts import Diagnosis, Finding
    from torchtop.monitor.model.playback import Playback
    from torchtop.monitor.model.state import RunState

__all__ = ["Event", "EventLog", "EventRole", "changes", "replayed", "stalled_s"]
RESUMED = "resumed"
UNKNOWN = "unknown"
RAISED = ("warning", "critical")  # a flag raised at these is news; an info flag is not
KEPT = 100  # a log's and a report's events: the newest this many
TICK_S = 1.0  # a report judges its window again once a second of steps, as the live view does
MAX_TICKS = 600  # ... at most this many times: a long window is judged at wider steps


def _line(f: Finding) -> str:
    return f.evidence[0] if f.evidence else ""


def changes(before: Diagnosis | None, after: Diagnosis, t: float) -> list[Event]:
    """The events between two successive diagnoses: the verdict's kind or severity changed (not
    into `unknown`: too few steps is no news), a stall ended, a flag raised or made worse. The
    first diagnosis (`before` None) is where the log starts: no change, no event."""
    if before is None:
        return []
    out: list[Event] = []
    was, now = before.verdict, after.verdict
    if was.kind == "stalled" and now.kind != "stalled" and now.kind != UNKNOWN:
        said = next((e for e in now.evidence if e.startswith("resumed ")), "steps end again")
        out.append(Event(t, RESUMED, "info", said, "resumed"))
    if now.kind != UNKNOWN and (was.kind, was.severity) != (now.kind, now.severity):
        out.append(Event(t, now.kind, now.severity, _line(now), "verdict"))
    flagged = {f.kind: f.severity for f in before.flags}
    for f in after.flags:
        if f.severity in RAISED and flagged.get(f.kind) != f.severity:
            if flagged.get(f.kind) != "critical":  # critical -> warning: easing, not news
                out.append(Event(t, f.kind, f.severity, _line(f), "flag"))
    return out


class EventLog:
    """One agent's or job's events across refreshes: the newest KEPT, and every one counted by
    (kind, severity) since the log began (the exporter's counter)."""

    def __init__(self) -> None:
        self.last: Diagnosis | None = None  # the verdict in force: the next judgement's hysteresis
        self.known: Diagnosis | None = (
            None  # the last one not `unknown`: what a change is from (None: none yet)
        )
        self.events: deque[Event] = deque(maxlen=KEPT)
        self.counts: Counter[tuple[str, str]] = Counter()

    def observe(self, diagnosis: Diagnosis, t: float) -> list[Event]:
        new = changes(self.known, diagnosis, t)
        self.last = diagnosis
        if diagnosis.verdict.kind != UNKNOWN:  # the first verdict known starts the log (no event):
            self.known = (
                diagnosis  # a report of a recording, which judges from its start, says what live said
            )
        self.events.extend(new)
        self.counts.update((e.kind, e.severity) for e in new)
        return new

    def since(self, start: float) -> list[Event]:
        return [e for e in self.events if e.time >= start]


def stalled_s(states: Iterable[RunState]) -> float:
    """How long the run (every state given: a job's ranks) has made no step progress, once a
    stall: 0 while any of them still ends steps."""
    silent: list[float] = []
    for st in states:
        if not st.steps:
            continue  # a rank relayed as buckets: no steps of its own to stall from
        s = run_stall(st)
        if s is None or s.ended is not None:
            return 0.0
        silent.append(s.silent_s)
    return min(silent) if silent else 0.0


def replayed(playback: Playback, until: float | None, seconds: float) -> list[Event]:
    """A recording's events in its last `seconds` up to `until`: its messages fed in order, the
    run judged once a recorded second (with the verdict in force: hysteresis) in that span."""
    from torchtop.monitor.diagnosis.diagnose import diagnose
    from torchtop.monitor.model.playback import apply
    from torchtop.monitor.model.state import RunState

    end = playback.end if until is None else min(until, playback.end)
    start = max(playback.start, end - seconds)
    step = max(TICK_S, (end - start) / MAX_TICKS)
    state = RunState()
    log = EventLog()
    due = start
    for played in playback.play(0, playback.index_at(end)):
        apply(state, [played])
        if state.agent_time >= due and state.steps:
            log.observe(diagnose(state, log.last), state.agent_time)
            due = state.agent_time + step
    if state.steps:
        log.observe(diagnose(state, log.last), state.agent_time)
    return log.since(start)[-KEPT:]
