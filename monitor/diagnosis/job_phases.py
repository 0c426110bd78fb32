"""The job's phases from its ranks' buckets, when the job has no aggregate steps (every node read
through its relay: the monitor holds no rank's steps): the mean rank's phase shares, `other` (time
outside the phases) included, give the verdict the aggregate's steps give on a direct
connection or a recording, so every path reads one answer. Pure: no textual, no zmq.
"""

from __future__ import annotations

from torchtop.contract.logcodes import PHASES
from torchtop.monitor.diagnosis.facts import Diagnosis, Facts
from torchtop.monitor.diagnosis.selection import primary, with_upsides
from torchtop.monitor.model.rank_stats import RankTimes


def times_facts(times: dict[int, RankTimes], device: str = "cpu") -> Facts | None:
    """Facts of the mean rank over the ranks whose phases were timed; None: none was."""
    timed = [t for t in times.values() if t.timed]
    if not timed:
        return None
    n = len(timed)
    ms = {p: sum(t.phases.get(p, 0.0) for t in timed) / n for p in PHASES}
    wall = sum(ms.values())  # `other` makes a timed step's phases add up to its wall time
    shares = {p: v / wall for p, v in ms.items()} if wall > 0 else dict.fromkeys(PHASES, 0.0)
    sampled = [t for t in times.values() if t.sampled]
    keys = sorted({k for t in sampled for k in t.device})
    device_ms = {k: sum(t.device.get(k, 0.0) for t in sampled) / len(sampled) for k in keys}
    step_ms = sum(t.step_ms for t in times.values()) / len(times)
    steps = sum(t.steps for t in times.values())
    return Facts(steps, step_ms, shares, ms, device=device, device_ms=device_ms)


def times_diagnosis(
    times: dict[int, RankTimes], device: str = "cpu", previous: str | None = None
) -> Diagnosis | None:
    """The verdict of the mean rank's figures (`previous`: the verdict before, for hysteresis)."""
    f = times_facts(times, device)
    if f is None:
        return None
    return with_upsides(Diagnosis(primary(f, previous), (), f.steps, f.step_ms), f)
