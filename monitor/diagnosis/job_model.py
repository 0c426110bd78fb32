"""The job model: what each rank does of its own, what it waits for, and what is only noise.

Per rank over the judged window (RankTimes): its host's own work (its timed phases less the
host's collective wait), its GPU's own work (copies, forward, backward and optimizer on the
compute stream, where CUDA events were sampled), its exposed collective wait, and its own time
(the step less that wait: the rank with the most arrives last at the collective, the others wait
for it). The job's noise band is measured, not assumed: the spread, second to second over the
window, of each other rank's own time, the median over them (how much identical ranks vary on
this machine under its load); with fewer than 3 seconds of steps it is 5% of the step.

A job whose every rank's host is busy about the whole step (its phases less its collective wait
and its wait on the GPU) while no rank's GPU computes half of it is host-bound: its GPUs wait for
Python, and their spans (which then hold the wait for each launch) say nothing about a rank's
speed, so only host figures are compared (straggler.py). What a fix buys is a what-if: the step
with the straggler's excess removed, never below what the other ranks' own work needs. Pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from statistics import median, pstdev
from typing import NamedTuple

from torchtop.monitor.diagnosis.facts import THRESHOLDS as T
from torchtop.monitor.diagnosis.facts import Facts
from torchtop.monitor.diagnosis.upside import Upside
from torchtop.monitor.diagnosis.why import device_busy_ms, site_words
from torchtop.monitor.model.fmt import pct
from torchtop.monitor.model.rank_stats import RankTimes

Seconds = Mapping[int, Sequence[tuple[int, RankTimes]]]  # each rank's (second, figures), oldest first
GPU_PHASES = ("h2d", "forward", "backward", "optimizer")
HOST_PHASES = ("forward", "backward", "optimizer", "other")


def host_view(t: RankTimes) -> RankTimes:
    """The rank as its host sees it: CUDA-event times left out."""
    return t._replace(sampled=0, device={}) if t.sampled else t


def host_busy(t: RankTimes) -> float:
    """Its host's own share of its timed steps: the phases less the collective wait."""
    total = sum(t.phases.values())
    return max(0.0, 1.0 - t.phases.get("comm", 0.0) / total) if total > 0 else 0.0


def device_own_ms(t: RankTimes) -> float | None:
    """Its GPU's own work a step (CUDA events), None where none was sampled."""
    if not t.sampled:
        return None
    return sum(t.device.get(k, 0.0) for k in GPU_PHASES)


class Noise(NamedTuple):
    band_ms: float
    seconds: int  # the seconds it was measured over; under T.noise_seconds: not measured

    @property
    def measured(self) -> bool:
        return self.seconds >= T.noise_seconds

    def words(self) -> str:
        if self.measured:
            return f"noise band {self.band_ms:.1f} ms (own time's second-to-second spread, {self.seconds} s)"
        return f"noise band {self.band_ms:.1f} ms ({pct(T.straggler_info, 0)} of the step: too few seconds to measure)"


def own_points(
    seconds: Seconds, window: Mapping[int, RankTimes], host: bool
) -> dict[int, list[tuple[int, float]]]:
    """Each judged rank's own ms a step, second by second (or 10 s span by span): the newest
    (still open) left out, and one whose collective wait comes from another source than its
    window's (no CUDA-event step in it) left out."""
    out: dict[int, list[tuple[int, float]]] = {}
    for r, pts in seconds.items():
        t = window.get(r)
        if t is None:
            continue
        device = not host and bool(t.sampled) and "comm" in t.device
        own: list[tuple[int, float]] = []
        for s, rt in list(pts)[:-1]:
            v = host_view(rt) if host else rt
            same = bool(v.sampled) and "comm" in v.device if device else v.timed and not v.sampled
            if v.steps and same:
                own.append((s, v.busy_ms))
        out[r] = own
    return out


def measure_noise(points: Mapping[int, Sequence[tuple[int, float]]], exclude: int, step_ms: float) -> Noise:
    """The band a rank's own time must clear: the median, over the ranks but `exclude`, of the
    spread of their own time second to second; the floor T.straggler_min_ms."""
    spreads: list[float] = []
    seen: list[int] = []
    for r, pts in points.items():
        values = [ms for _, ms in pts]
        if r != exclude and len(values) >= T.noise_seconds:
            spreads.append(pstdev(values))
            seen.append(len(values))
    if not spreads:
        return Noise(max(T.straggler_min_ms, T.straggler_info * step_ms), 0)
    return Noise(max(T.straggler_min_ms, median(spreads)), int(median(seen)))


def ahead_seconds(
    points: Mapping[int, Iterable[tuple[int, float]]], rank: int, band: float
) -> tuple[int, int]:
    """(seconds in which `rank`'s own time exceeded the others' median by more than `band`,
    seconds it and another rank both have figures for): the slowest in most seconds, by more than
    noise (persistence.py's test at the scale of the window, with the band as its margin)."""
    by_second: dict[int, dict[int, float]] = {}
    for r, pts in points.items():
        for t, ms in pts:
            by_second.setdefault(t, {})[r] = ms
    hits = seen = 0
    for row in by_second.values():
        if rank in row and len(row) >= 2:
            seen += 1
            hits += row[rank] - median(ms for r, ms in row.items() if r != rank) > band
    return hits, seen


def confidence(noise: Noise, clear: bool, slowest: tuple[int, int] | None = None) -> str:
    """How sure the job verdict is, in a line: high where the band was measured over 5 s or more
    and the evidence is `clear` of it, moderate where measured, else low."""
    level = "low"
    if noise.measured:
        level = "high" if clear and noise.seconds >= 5 else "moderate"
    held = f"; ahead by more in {slowest[0]} of {slowest[1]} s" if slowest is not None and slowest[1] else ""
    return f"confidence {level}: {noise.words()}{held}"


def times_words(x: float, sign: str = "x") -> str:
    """A ratio as said: "1.6x", "over 10x" (10 s means do not say more)."""
    return f"over {T.speedup_cap:.0f}{sign}" if x > T.speedup_cap else f"{x:.1f}{sign}"


def what_if(what: str, step: float, new: float, band: float = 0.0) -> Upside | None:
    """What a job would gain with its step at `new` ms: "no measurable gain" under the noise band."""
    if step <= 0:
        return None
    if new <= 0 or step - new <= band:
        within = f" (within the {band:.1f} ms noise band)" if band > 0 else ""
        return Upside(f"{what}: no measurable gain{within}", "bound", step, step, 1.0)
    x = step / new
    return Upside(
        f"{what}: up to {times_words(x, '×')} steps/s ({step:.1f} → {new:.1f} ms a step; bound)",
        "bound",
        step,
        new,
        min(x, T.speedup_cap),
    )


class HostSide(NamedTuple):
    """A rank's host and GPU as its own figures see them (its Facts), for the host-bound verdict."""

    gpu_busy: float | None  # the share of the step its GPU computes; None: not known (CPU)
    source: str  # where that share comes from
    blocked: float = 0.0  # the share of the step its host waits on the GPU (stack samples)
    hot: str = ""  # its host's hot spot in words ("": not named)


def host_side(f: Facts) -> HostSide:
    """GPM's SM activity where the GPU reads it (NVML calls a GPU spinning in NCCL busy), else
    the smaller of NVML's utilisation and the CUDA events' kernel spans."""
    busy: float | None = None
    source = ""
    if f.gpm is not None and f.gpm.sm_active is not None:
        busy, source = f.gpm.sm_active / 100.0, "GPM SM activity"
    elif f.step_ms > 0:
        ms, source = device_busy_ms(f)
        busy = ms / f.step_ms if ms is not None else None
    w = f.why
    blocked = w.fold.sync_share() if w is not None and w.enough else 0.0
    return HostSide(None if busy is None else min(1.0, max(0.0, busy)), source, blocked, _hot(f))


def _hot(f: Facts) -> str:
    """The host's hot spot: the top site of its longest phase, where the stack samples name one."""
    w = f.why
    if w is None or not w.enough:
        return ""
    phase = max(HOST_PHASES, key=lambda p: f.ms.get(p, 0.0))
    if w.fold.by_phase.get(phase, 0) < T.min_phase_samples:
        return ""
    funcs, sites = w.fold.functions.get(phase, []), w.fold.host_sites.get(phase, [])
    top = funcs[0] if funcs and (not sites or funcs[0].share >= sites[0].share) else None
    top = top or (sites[0] if sites else None)
    return f"{phase}: {site_words(top)}" if top is not None else ""


class HostBound(NamedTuple):
    """Every rank's host busy about the whole step while the GPUs idle: the figures of it."""

    host: tuple[float, float]  # the least and most busy host, share of its step
    gpu: tuple[float, float]  # the least and most busy GPU
    source: str
    hot: str  # the hot spot of the busiest host, with its rank ("" none)
    ranks: int


def find_host_bound(
    times: Mapping[int, RankTimes], hosts: Mapping[int, HostSide], scale: float = 1.0
) -> HostBound | None:
    """The job is host-bound: every judged rank's host busy >= T.host_bound of its step, and
    every rank whose GPU is read computes under T.gpu_busy of it (two such ranks at least)."""
    judged = {r: t for r, t in times.items() if t.steps >= T.min_steps and t.timed}
    gpus = {r: h for r, h in hosts.items() if r in judged and h.gpu_busy is not None}
    if len(judged) < 2 or len(gpus) < 2:
        return None
    busy = {r: host_busy(t) - (hosts[r].blocked if r in hosts else 0.0) for r, t in judged.items()}
    shares = [h.gpu_busy for h in gpus.values() if h.gpu_busy is not None]
    # scaled as the host's idle share, so that x1.25 stays reachable
    if 1.0 - min(busy.values()) > (1.0 - T.host_bound) / scale or max(shares) >= T.gpu_busy / scale:
        return None
    sources = sorted({h.source for h in gpus.values() if h.source})
    top = max(busy, key=lambda r: busy[r])
    hot = next((f"rank {r}'s {h.hot}" for r, h in sorted(hosts.items()) if h.hot and r == top), "")
    hot = hot or next((f"rank {r}'s {h.hot}" for r, h in sorted(hosts.items()) if h.hot), "")
    return HostBound(
        (min(busy.values()), max(busy.values())),
        (min(shares), max(shares)),
        ", ".join(sources),
        hot,
        len(judged),
    )
