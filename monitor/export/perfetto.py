"""Steps as a Perfetto / Chrome trace (the JSON trace-event format ui.perfetto.dev opens). Pure.

One process per rank, its thread `steps`: a slice per step, and inside it a slice per phase.
The log times each phase's total within a step, not each time it was entered, so the phases
are laid end to end in step order (data, h2d, forward, backward, optimizer, then the rest):
their lengths are exact, their order within the step is the usual one. Times are whole
microseconds from the earliest event (children tile their step exactly, and a step that
starts where the previous one ended never overlaps it by a rounding microsecond). Memory and RSS samples become counter tracks. A torch.profiler trace (a capture) is
merged in on the same clock: its events move into the process of the rank that took it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from torchtop.contract.logcodes import PHASES
from torchtop.contract.wire import Hello, Telemetry
from torchtop.monitor.model.steps import StepRecord

STEPS_TID = 1
CAPTURE_PID_BASE = 100_000  # a capture's device processes (GPU streams) go above the ranks'


@dataclass
class RankTrace:
    rank: int
    hello: Hello | None
    steps: list[StepRecord] = field(default_factory=list)
    telemetry: list[Telemetry] = field(default_factory=list)
    pid: int = (
        0  # the trace's process for this rank: set by chrome_trace (several recordings may share a rank)
    )

    @property
    def label(self) -> str:
        h = self.hello
        where = f" · {h.host} pid {h.pid}" if h else ""
        device = f" · {h.device_name or h.device}" if h else ""
        return f"rank {self.rank}{where}{device}"


def _us(seconds_from_origin: float) -> int:
    return round(seconds_from_origin * 1e6)


ROUNDING_US = 2  # a step that starts this little before the previous one ended: rounding


def step_events(
    rank: RankTrace, origin: float, last_end: dict[str, int] | None = None
) -> list[dict[str, Any]]:
    """`last_end`: per kind (train, eval), where its previous step's slice ended on the track;
    carried from one chunk of a recording to the next (a fresh one when None)."""
    out: list[dict[str, Any]] = []
    last_end = {} if last_end is None else last_end
    for s in rank.steps:
        start = s.t0 - origin
        t0 = _us(start)
        end = _us(start + s.wall_ns / 1e9)
        for before in last_end.values():  # either kind's: train and eval steps share the track
            if t0 < before <= t0 + ROUNDING_US:
                t0 = min(before, end)  # the steps touch: rounding two float times made them overlap
        last_end[s.kind] = end
        args: dict[str, Any] = {"step": s.i, "wall_ms": round(s.wall_ns / 1e6, 4)}
        if s.phases:
            args["phases_ms"] = {p: round(s.phases.get(p, 0) / 1e6, 4) for p in PHASES}
        if s.device_ms:
            args["device_ms"] = {k: round(v, 4) for k, v in s.device_ms.items()}
        if s.marks:  # a NaN loss is news, but not valid JSON: said as a string
            args["marks"] = {k: v if math.isfinite(v) else str(v) for k, v in s.marks.items()}
        if s.micro != 1:
            args["micro_batches"] = s.micro
        name = f"{'eval' if s.kind == 'eval' else 'step'} {s.i}"
        out.append(
            {
                "ph": "X",
                "name": name,
                "cat": s.kind,
                "pid": rank.pid,
                "tid": STEPS_TID,
                "ts": t0,
                "dur": end - t0,
                "args": args,
            }
        )
        cum = 0
        for p in PHASES:
            ns = s.phases.get(p, 0)
            if ns <= 0:
                continue
            a = max(t0, _us(start + cum / 1e9))
            cum += ns
            b = end if cum >= s.wall_ns else min(end, _us(start + cum / 1e9))
            if b > a:
                out.append(
                    {
                        "ph": "X",
                        "name": p,
                        "cat": "phase",
                        "pid": rank.pid,
                        "tid": STEPS_TID,
                        "ts": a,
                        "dur": b - a,
                    }
                )
    return out


def counter_events(rank: RankTrace, origin: float) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for t in rank.telemetry:
        ts = _us(t.time - origin)
        if t.memory:
            m = t.memory[0]
            out.append(
                {
                    "ph": "C",
                    "name": "CUDA memory (MiB)",
                    "pid": rank.pid,
                    "ts": ts,
                    "args": {"allocated": m.allocated / 2**20, "reserved": m.reserved / 2**20},
                }
            )
        if t.host is not None:
            out.append(
                {
                    "ph": "C",
                    "name": "process RSS (MiB)",
                    "pid": rank.pid,
                    "ts": ts,
                    "args": {"rss": t.host.proc_rss / 2**20},
                }
            )
    return out


def capture_events(trace: dict[str, Any], ranks: list[RankTrace], origin: float) -> list[dict[str, Any]]:
    """A torch.profiler Chrome trace's events on this trace's clock. Its host process becomes
    the rank's (matched by pid and host name); its other processes (GPU devices) get pids of
    their own under that rank."""
    base_us = trace.get("baseTimeNanoseconds", 0) / 1e3
    host = trace.get("host_name")
    owner = next(
        (
            r
            for r in ranks
            if r.hello is not None and (host is None or r.hello.host == host) and _has_pid(trace, r.hello.pid)
        ),
        ranks[0] if len(ranks) == 1 else None,
    )
    out = []
    for e in trace.get("traceEvents", []):
        if not isinstance(e, dict) or "ph" not in e:
            continue
        e = dict(e)
        pid = e.get("pid")
        if owner is not None and owner.hello is not None and pid == owner.hello.pid:
            e["pid"] = owner.pid
        elif isinstance(pid, int):
            e["pid"] = CAPTURE_PID_BASE + (owner.rank if owner else 0) * 100 + pid % 100
        else:
            continue  # a global instant ("Record Window End") with no process
        if e["ph"] == "M" and e.get("name") == "process_name" and e["pid"] == (owner.pid if owner else None):
            continue  # the rank names its own process
        if "ts" in e and isinstance(e["ts"], (int, float)):
            e["ts"] = round(e["ts"] + base_us - origin * 1e6, 3)
        out.append(e)
    return out


def _has_pid(trace: dict[str, Any], pid: int) -> bool:
    return any(isinstance(e, dict) and e.get("pid") == pid for e in trace.get("traceEvents", [])[:200])


def capture_start(trace: dict[str, Any]) -> float | None:
    """The earliest event of a profiler trace, in unix seconds."""
    base_us = trace.get("baseTimeNanoseconds", 0) / 1e3
    stamps = [
        e["ts"]
        for e in trace.get("traceEvents", [])
        if isinstance(e, dict) and isinstance(e.get("ts"), (int, float))
    ]
    return (min(stamps) + base_us) / 1e6 if stamps else None


def metadata_events(r: RankTrace) -> list[dict[str, Any]]:
    return [
        {"ph": "M", "name": "process_name", "pid": r.pid, "tid": 0, "args": {"name": r.label}},
        {"ph": "M", "name": "process_sort_index", "pid": r.pid, "tid": 0, "args": {"sort_index": r.rank}},
        {"ph": "M", "name": "thread_name", "pid": r.pid, "tid": STEPS_TID, "args": {"name": "steps"}},
    ]


def write_trace(fh: Any, events: Iterable[dict[str, Any]], origin: float) -> None:
    """The trace to a text file, one event at a time: memory bounded by one event, whatever
    the recording's length (what chrome_trace returns, as JSON)."""
    fh.write('{"traceEvents": [')
    sep = "\n"
    for e in events:
        fh.write(sep)
        fh.write(json.dumps(e, separators=(",", ":")))
        sep = ",\n"
    other = json.dumps({"producer": "torchtop", "origin_unix_s": origin})
    fh.write(f'\n], "displayTimeUnit": "ms", "otherData": {other}}}\n')


def rank_events(
    r: RankTrace, chunks: Iterable[tuple[list[StepRecord], list[Telemetry]]], origin: float
) -> Iterator[dict[str, Any]]:
    """A rank's metadata, then its steps and counters chunk by chunk (a recording's batches)."""
    yield from metadata_events(r)
    last_end: dict[str, int] = {}  # a step at a chunk's start touches the last one of the previous chunk
    for steps, telemetry in chunks:
        part = RankTrace(r.rank, r.hello, steps, telemetry, r.pid)
        yield from step_events(part, origin, last_end)
        yield from counter_events(part, origin)


def chrome_trace(ranks: list[RankTrace], captures: Iterable[dict[str, Any]] = ()) -> dict[str, Any]:
    """The whole trace: metadata, then each rank's steps and counters, then the captures."""
    captures = list(captures)
    starts = [s.t0 for r in ranks for s in r.steps[:1]] + [t.time for r in ranks for t in r.telemetry[:1]]
    starts += [x for x in map(capture_start, captures) if x is not None]
    origin = min(starts) if starts else 0.0
    events: list[dict[str, Any]] = []
    for k, r in enumerate(ranks, 1):  # 0 is not a good pid for every viewer
        r.pid = k
    for r in ranks:
        events += metadata_events(r)
        events += step_events(r, origin)
        events += counter_events(r, origin)
    for c in captures:
        events += capture_events(c, ranks, origin)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"producer": "torchtop", "origin_unix_s": origin},
    }
