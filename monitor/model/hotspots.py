"""Stack samples folded onto steps: where each phase's host time goes, and the waits on the GPU.

Only samples that fell inside the given training steps count (an evaluation pass, a pause, a
checkpoint between steps are not the steps' time). Each phase's samples are split by site (the
innermost frame of the user's code and what it was calling); the phase shares themselves come
from the probe's timing, which is exact, not from the samples. A sample is one instant: a site's
share of a phase's samples estimates its share of that phase's time (docs/why.md: how the GIL
bends it).
"""

from __future__ import annotations

import bisect
import os
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import msgspec

from torchtop.contract.logcodes import PHASES, SAMPLE_PHASES
from torchtop.contract.why import StackSample, function_of
from torchtop.monitor.model.steps import StepRecord

TOP_SITES = 5
_SITE = re.compile(r"^(.*):(\d+)(?: (.*))?$")


@dataclass(frozen=True)
class SiteShare:
    site: str  # "path:line qualname"
    callee: str  # "module:qualname", "" when the site itself was the innermost frame
    samples: int
    share: float  # of its phase's samples

    def to_json(self) -> dict[str, object]:
        return {
            "site": self.site,
            "callee": self.callee,
            "samples": self.samples,
            "share": round(self.share, 4),
        }


@dataclass(frozen=True)
class FunctionShare(SiteShare):
    """A function of the user's, its samples summed over its lines (and its comprehensions):
    `site` and `callee` are its line with the most samples, `caller` where it was called from
    the most ("path:line function"; "" when unknown)."""

    caller: str = ""

    def to_json(self) -> dict[str, object]:
        return super().to_json() | {"caller": self.caller}


@dataclass
class Fold:
    samples: int = 0  # samples inside the steps
    late: int = 0  # of which came late (the training thread held the GIL)
    by_phase: dict[str, int] = field(default_factory=dict[str, int])
    sites: dict[str, list[SiteShare]] = field(
        default_factory=dict[str, list[SiteShare]]
    )  # per phase, the top sites
    host_sites: dict[str, list[SiteShare]] = field(
        default_factory=dict[str, list[SiteShare]]
    )  # the same, not blocked on the GPU
    sync: int = 0  # samples blocked at a synchronising call
    sync_by_site: dict[str, int] = field(default_factory=dict[str, int])
    sync_by_phase: dict[str, int] = field(default_factory=dict[str, int])
    # per phase, the user's functions the samples not blocked on the device were in, most first
    functions: dict[str, list[FunctionShare]] = field(default_factory=dict[str, list[FunctionShare]])
    inputs: int = 0  # `other` samples resuming the loop's input generator (data wait no hook timed)
    input_sites: list[SiteShare] = field(default_factory=list[SiteShare])  # where in the generator

    def input_share(self, other: float) -> float:
        """The share of the step spent resuming the loop's input generator: `other` (the
        step's exact share outside the phases) times the input samples' share of its samples."""
        n = self.by_phase.get("other", 0)
        return other * self.inputs / n if n else 0.0

    def share(self, phase: str) -> float:
        """A phase's share of the samples (the probe's own phase shares are the exact ones)."""
        return self.by_phase.get(phase, 0) / self.samples if self.samples else 0.0

    def sync_share(self, site: str | None = None) -> float:
        """Share of all samples that found the thread blocked on the device (at `site`)."""
        n = self.sync if site is None else self.sync_by_site.get(site, 0)
        return n / self.samples if self.samples else 0.0


def _phase_name(index: int) -> str:
    return SAMPLE_PHASES[index] if 0 <= index < len(SAMPLE_PHASES) else "other"


def in_steps(samples: Iterable[tuple[float, StackSample]], steps: Sequence[StepRecord]) -> list[StackSample]:
    """The samples whose time falls inside one of `steps` (in order of time)."""
    if not steps:
        return []
    starts = [s.t0 for s in steps]
    ends = [s.t0 + s.wall_ns / 1e9 for s in steps]
    lo, hi = starts[0], ends[-1]
    out: list[StackSample] = []
    for t, sample in samples:
        if t < lo or t >= hi:
            continue
        k = bisect.bisect_right(starts, t) - 1
        if k >= 0 and t < ends[k]:
            out.append(sample)
    return out


def fold(
    samples: Iterable[tuple[float, StackSample]], steps: Sequence[StepRecord], top: int = TOP_SITES
) -> Fold:
    """The samples that fell in `steps`, by phase and site."""
    got = in_steps(samples, steps)
    f = Fold(samples=len(got))
    counts: dict[str, Counter[tuple[str, str]]] = {}
    host: dict[str, Counter[tuple[str, str]]] = {}
    inputs: Counter[tuple[str, str]] = Counter()
    funcs: dict[str, dict[tuple[str, str], tuple[Counter[tuple[str, str]], Counter[str]]]] = {}
    for s in got:
        phase = _phase_name(s.phase)
        f.by_phase[phase] = f.by_phase.get(phase, 0) + 1
        f.late += s.late
        counts.setdefault(phase, Counter())[(s.site, s.callee)] += 1
        if s.sync and phase != "h2d":  # a blocking copy to the GPU is transfer time, judged as such
            f.sync += 1
            f.sync_by_site[s.site] = f.sync_by_site.get(s.site, 0) + 1
            f.sync_by_phase[phase] = f.sync_by_phase.get(phase, 0) + 1
        elif phase == "other" and s.input:
            f.inputs += 1
            inputs[(s.site, s.callee)] += 1
        else:
            host.setdefault(phase, Counter())[(s.site, s.callee)] += 1
            path, _, qual = split_site(s.site)
            key = (path, function_of(qual))
            per = funcs.setdefault(phase, {}).setdefault(key, (Counter(), Counter()))
            per[0][(s.site, s.callee)] += 1
            per[1][s.caller] += 1
    if f.inputs:
        f.input_sites = [
            SiteShare(site, callee, k, k / f.inputs) for (site, callee), k in inputs.most_common(top)
        ]
    for phase, per_fn in funcs.items():
        n = f.by_phase[phase] - f.sync_by_phase.get(phase, 0) - (f.inputs if phase == "other" else 0)
        ranked = sorted(per_fn.values(), key=lambda lc: -sum(lc[0].values()))[:top]
        f.functions[phase] = [
            FunctionShare(_named(site), callee, k, k / n, _named(callers.most_common(1)[0][0]))
            for lines, callers in ranked
            if (k := sum(lines.values()))
            for (site, callee), _ in lines.most_common(1)
        ]
    for phase, c in counts.items():
        n = f.by_phase[phase]
        f.sites[phase] = [SiteShare(site, callee, k, k / n) for (site, callee), k in c.most_common(top)]
    for phase, c in host.items():
        n = f.by_phase[phase] - f.sync_by_phase.get(phase, 0) - (f.inputs if phase == "other" else 0)
        f.host_sites[phase] = [SiteShare(site, callee, k, k / n) for (site, callee), k in c.most_common(top)]
    return f


def _named(site: str) -> str:
    """A site named by its function: "/a/t.py:25 f.<locals>.<genexpr>" -> "/a/t.py:25 f"."""
    path, line, qual = split_site(site)
    return f"{path}:{line} {function_of(qual)}" if line else site


def with_input_wait(shares: dict[str, float], fold: Fold, min_samples: int) -> tuple[dict[str, float], float]:
    """`shares` with the time the loop spent resuming its input generator (a share of `other`
    estimated from the stack samples, once at least `min_samples` found it) moved to `data`;
    and the share moved."""
    other = shares.get("other", 0.0)
    if fold.inputs < min_samples or other <= 0:
        return shares, 0.0
    moved = fold.input_share(other)
    out = dict(shares)
    out["data"] = out.get("data", 0.0) + moved
    out["other"] = other - moved
    return out, moved


STALL_NS = 500_000_000  # an untimed step this long is a stall phase sampling skipped, not a fast step
STALL_SAMPLES = 8  # ... and its phases are estimated from its stack samples once it holds this many


def stall_phases(steps: list[StepRecord], samples: Sequence[tuple[float, StackSample]]) -> list[StepRecord]:
    """`steps` with each untimed training step of STALL_NS or more (a DataLoader worker starting, a
    checkpoint: phase sampling times a random few fast steps and may skip the one that stalls)
    given phases from its stack samples: each phase's share of them times its wall time. The
    wrappers are on the stack on untimed steps too, so the samples say which phase it sat in."""
    if not samples or not any(not s.phases and s.kind == "train" and s.wall_ns >= STALL_NS for s in steps):
        return steps
    held = list(samples)
    times = [t for t, _ in held]
    out: list[StepRecord] = []
    for s in steps:
        if s.phases or s.kind != "train" or s.wall_ns < STALL_NS:
            out.append(s)
            continue
        lo = bisect.bisect_left(times, s.t0)
        hi = bisect.bisect_left(times, s.t0 + s.wall_ns / 1e9)
        got = Counter(_phase_name(sample.phase) for _, sample in held[lo:hi])
        n = sum(got.values())
        if n < STALL_SAMPLES:
            out.append(s)
            continue
        phases = {p: s.wall_ns * got[p] // n for p in PHASES if got[p]}
        phases["other"] = phases.get("other", 0) + s.wall_ns - sum(phases.values())  # they add up
        out.append(msgspec.structs.replace(s, phases=phases))
    return out


def split_site(site: str) -> tuple[str, int, str]:
    """ "/a/b/train.py:88 log_metrics" -> ("/a/b/train.py", 88, "log_metrics"); (site, 0, "") if not."""
    m = _SITE.match(site)
    return (m.group(1), int(m.group(2)), m.group(3) or "") if m else (site, 0, "")


def short_site(site: str) -> str:
    """ "/a/b/train.py:88 log_metrics" -> "train.py:88 log_metrics"."""
    path, line, qual = split_site(site)
    if not line:
        return os.path.basename(site) or "?"
    return f"{os.path.basename(path)}:{line} {qual}".rstrip()


def short_callee(callee: str) -> str:
    """ "wandb.sdk.wandb_run:Run.log" -> "wandb…Run.log"; "json:dumps" -> "json.dumps"."""
    module, _, qual = callee.partition(":")
    if not qual:
        return module
    top = module.split(".", 1)[0]
    return f"{top}…{qual}" if top != module else f"{module}.{qual}"
