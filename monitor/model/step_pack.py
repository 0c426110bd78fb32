# pyright: basic
# basic, not strict: the replay's raw step tuples are untyped for speed (replay.py)
"""A replayed step packed: the raw tuple StepRecorder hands over (replay.py) becomes the
monitor's StepRecord, with its device times summed by phase."""

from __future__ import annotations

import math
from typing import Any

from torchtop.contract.logcodes import TIMED_PHASES
from torchtop.monitor.model.steps import StepRecord


def finite_ms(value: Any) -> float | None:
    """A device time from the log: a finite float, else None."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def phase_ms(events: list[tuple[int, float, float | None]]) -> dict[str, float]:
    ms: dict[str, float] = {}
    for phase, start, end in events:
        if end is None:
            continue
        name = "step" if phase < 0 else TIMED_PHASES[phase]
        ms[name] = ms.get(name, 0.0) + (end - start)
    return ms


def _open_index(events: list[tuple[int, float, float | None]], phase: int) -> int | None:
    """Where the most recent open device pair of `phase` is (the step's own, index 0, never)."""
    for k in range(len(events) - 1, 0, -1):
        p, _, end = events[k]
        if p == phase and end is None:
            return k
    return None


def close_pair(events: list[tuple[int, float, float | None]], phase: int, ms: float) -> bool:
    """Close the most recent open device pair of `phase` at `ms` (the step's own, index 0, never);
    whether there was one."""
    k = _open_index(events, phase)
    if k is None:
        return False
    events[k] = (phase, events[k][1], ms)
    return True


def drop_open(events: list[tuple[int, float, float | None]], phase: int) -> None:
    """Forget the most recent open device pair of `phase` (the step's own, index 0, never)."""
    k = _open_index(events, phase)
    if k is not None:
        del events[k]


def open_start(events: list[tuple[int, float, float | None]] | None, phase: int) -> float | None:
    """The device start of `phase`'s open pair on an event step, else None."""
    for p, start, end in reversed(events or ()):
        if p == phase and end is None:
            return start
    return None


def to_record(raw: tuple, wall_offset: float, rank: int) -> StepRecord:
    """A replayed step as the monitor keeps it; `other` is the step's unaccounted rest."""
    index, kind, t0_ns, wall_ns, acc, micro, device_ms, extra = raw
    if acc is None:  # not timed (phase sampling): its wall time only
        phases: dict[str, int] = {}
        micro = 0
    else:
        data, h2d, forward, backward, optimizer, comm, checkpoint = acc
        phases = {
            "data": data,
            "h2d": h2d,
            "forward": forward,
            "backward": backward,
            "optimizer": optimizer,
            "comm": comm,
            "checkpoint": checkpoint,
            "other": max(0, wall_ns - data - h2d - forward - backward - optimizer - comm - checkpoint),
        }
    record = StepRecord(index, t0_ns / 1e9 + wall_offset, wall_ns, phases, kind, micro, device_ms or {}, rank)
    if extra:
        record.skipped = extra.get("skipped", 0)
        record.h2d_bytes = {k: extra[k] for k in ("pinned", "pageable") if k in extra}
        record.marks = dict(extra.get("marks", {}))
        record.samples, record.tokens, record.seq = (
            extra.get("samples", 0),
            extra.get("tokens", 0),
            extra.get("seq", 0),
        )
        record.comm_groups = dict(extra.get("comm_groups", {}))
        record.device_groups = dict(extra.get("device_groups", {}))
        record.at_backward = bool(extra.get("at_backward", False))
        record.saves, record.saved_ns = extra.get("saves", 0), extra.get("saved_ns", 0)
    return record
