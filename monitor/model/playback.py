"""A recording, read back as the live stream would have brought it: hellos and batches, each
batch with the steps replayed from its log. Pure (files, no zmq, no textual).

`report FILE`, `compare` and the exporters feed a RunState from it at once (`state_until`); the
replay TUI walks it at a chosen speed and seeks by time or step (`position_of_step`,
`index_at`), starting a fresh replay a little before the target so the panels' windows
(10 s, the verdict's 10 s / 50 steps, the leak check's 60 s) are full when it gets there.
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_right
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from torchtop.contract import wire
from torchtop.contract.recording_reader import NO_TIME, RankRecording, open_recording, rank_dirs, read_rank
from torchtop.monitor.model.log_replay import LogReplay
from torchtop.monitor.model.state import RunState
from torchtop.monitor.model.steps import StepRecord

LEAD_S = 70.0  # a seek replays this much before its target: the leak check's 60 s horizon and more


@dataclass
class Played:
    """One recorded message; for a batch, the steps its log completes (replayed in order)."""

    msg: wire.Hello | wire.Batch
    steps: list[StepRecord]
    log_errors: int = 0


class Playback:
    """One rank's recording, indexed by time and by step count."""

    def __init__(self, recording: RankRecording) -> None:
        self.recording = recording
        self.messages = recording.messages
        self.warnings = recording.warnings
        # per message: its batch time (a hello: the batch before it, or the first batch's)
        self.times = array("d")
        self.step_counts = recording.step_counts  # per message: the agent's step count after it
        first = next((x for x in recording.times if x != NO_TIME), 0.0)
        t = first
        for x in recording.times:
            t = t if x == NO_TIME else x
            self.times.append(t)

    @property
    def hello(self) -> wire.Hello | None:
        return self.recording.hello

    @property
    def start(self) -> float:
        return self.times[0]

    @property
    def end(self) -> float:
        return self.times[-1]

    @property
    def steps_total(self) -> int:
        return self.step_counts[-1] if self.step_counts else 0

    def index_at(self, t: float) -> int:
        """How many messages lie at or before time `t`."""
        return bisect_right(self.times, t)

    def no_steps(self, who: str = "the recording") -> str | None:
        """A line when its batches' log yields no step at all (entries no replay reads, or a run
        stopped before its first step), else None; replays only up to the first step."""
        replay = LogReplay()
        batches = 0
        for played in self.play(replay=replay):
            if isinstance(played.msg, wire.Batch):
                batches += 1
                if played.steps:
                    return None
        unread = f"; {replay.failures} log chunk(s) could not be read" if replay.failures else ""
        return f"{who}: {batches} batch(es) recorded, but their log yields no steps{unread}"

    def time_of_step(self, step: int) -> float:
        """The time of the batch that brought step `step` (0-based, the agent's count)."""
        k = bisect_right(self.step_counts, step)
        return self.times[min(k, len(self.times) - 1)]

    def play(
        self, start: int = 0, stop: int | None = None, replay: LogReplay | None = None
    ) -> Iterator[Played]:
        """Messages [start, stop) with their steps, through `replay` (a fresh one by default:
        a start mid-recording leaves out the step it joins in, as a late monitor would). The
        last message releases every step (a live monitor holds the newest for a while)."""
        replay = replay or LogReplay()
        last = len(self.messages) - 1
        for k in range(start, len(self.messages) if stop is None else min(stop, last + 1)):
            m = self.messages[k]
            if isinstance(m, wire.Batch):
                if not replay.run_id and replay.next_seq is None:
                    replay.run_id = m.run_id  # a caller's fresh replay: kept across its calls
                elif m.run_id != replay.run_id:
                    replay = _fresh(replay, m.run_id)
                # the recording's end: the step held for a mark that may follow is let go
                steps = replay.feed(m.log, m.wall_offset, m.rank, flush=k == last)
                yield Played(m, steps, replay.failures)
            else:
                yield Played(m, [])

    def state_until(self, t: float | None = None, since: float | None = None) -> RunState:
        """A RunState fed with every message up to time `t` (default: all), starting at
        `since` (default: the start), as a monitor attached all along would hold it."""
        state = RunState()
        lo = 0 if since is None else max(0, self.index_at(since) - 1)
        hi = None if t is None else self.index_at(t)
        apply(state, self.play(lo, hi))
        return state


def _fresh(replay: LogReplay, run_id: str) -> LogReplay:
    fresh = LogReplay(run_id)
    fresh.rec.failures = replay.failures
    return fresh


def apply(state: RunState, played: Iterator[Played] | list[Played]) -> None:
    """Feed played messages into a RunState as the live monitor does (its clock: the batch's)."""
    for p in played:
        if isinstance(p.msg, wire.Hello):
            state.apply_hello(p.msg)
        else:
            state.apply_batch(p.msg, p.steps, p.msg.time, p.log_errors)


def load(path: Path | str, rank: int | None = None) -> tuple[Playback, dict[int, Path]]:
    """The recording at `path` (one rank: `rank`, default the lowest) and all its ranks.
    RecordingError when it is not one, or holds no such rank."""
    from torchtop.contract.recording import RecordingError

    found = open_recording(Path(path))
    odd = rank_dirs(Path(path))[1] if Path(path).is_dir() else []  # rank entries not read: said
    if rank is None:  # the lowest rank that reads (a job's rank may have died before its first batch)
        first: RecordingError | None = None
        for r in found:
            try:
                playback = Playback(read_rank(found[r]))
            except RecordingError as exc:
                first = first or exc
                continue
            playback.warnings += odd
            return playback, found
        assert first is not None  # open_recording names at least one rank
        raise first
    if rank not in found:
        raise RecordingError(f"{path}: no rank {rank} in it (ranks: {', '.join(map(str, found))})")
    playback = Playback(read_rank(found[rank]))
    playback.warnings += odd
    return playback, found


def notes(playback: Playback, ranks: dict[int, Path], asked: int | None, doing: str) -> list[str]:
    """The lines a command says on opening a recording: its damage, and which rank of a job
    it `doing` (reports, replays) when none was asked for."""
    out = list(playback.warnings)
    rank = next((r for r, where in ranks.items() if where == playback.recording.directory), min(ranks))
    empty = playback.no_steps(f"rank {rank}" if len(ranks) > 1 else str(playback.recording.directory))
    out += [empty] if empty else []
    if len(ranks) > 1 and asked is None:
        out.append(f"{len(ranks)} ranks recorded; {doing} rank {rank} (--rank N for another)")
    return out


def parse_when(text: str) -> float:
    """Seconds from "90", "90s", "1:30", "1:02:03" or "2m"; ValueError otherwise (NaN, inf too)."""
    value = _when(text)
    if not math.isfinite(value) or abs(value) > 1e11:
        raise ValueError(f"{text[:40]!r} is not a time")
    return value


def _when(text: str) -> float:
    text = text.strip().lower()
    if ":" in text:
        value = 0.0
        for part in text.split(":"):
            value = value * 60 + float(part)
        return value
    for suffix, scale in (("ms", 1e-3), ("s", 1.0), ("m", 60.0), ("h", 3600.0)):
        if text.endswith(suffix) and text[: -len(suffix)].replace(".", "", 1).isdigit():
            return float(text[: -len(suffix)]) * scale
    return float(text)


def resolve_until(playback: Playback, until: str | None) -> float | None:
    """`--until`: seconds into the recording ("90", "1:30") or a unix time; None: the end."""
    if until is None:
        return None
    t = parse_when(until)
    return t if t > 1e9 else playback.start + t
