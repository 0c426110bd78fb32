"""Saves as a bottleneck: the `checkpoint` verdict and its what-if at a longer save interval.

A save (torch.save, DCP's save and async staging and wait, safetensors: agent/hooks/checkpoint.py)
is the `checkpoint` phase of the step it runs in; each step also carries its saves and their
time whether its phases were timed or not (phase sampling), so the share here is over every
judged step. The interval is the judged steps per save; the what-if moves saves 10x further apart
with the same cost a save and the same step without one. A save can cost after it returns too:
DCP's async staging and upload run beside the next steps and slow them (NVIDIA-NeMo/Automodel
#3131: ~10x); the steps just after each save are compared with those far from one, and their
excess, where it is above the steps' noise after most saves, is the save's cost as well. Pure:
no textual, no zmq, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from statistics import median
from typing import TYPE_CHECKING, NamedTuple

from torchtop.monitor.diagnosis.facts import THRESHOLDS as T
from torchtop.monitor.diagnosis.facts import Finding, Severity
from torchtop.monitor.diagnosis.job_model import measure_noise, times_words
from torchtop.monitor.diagnosis.upside import Upside, faster
from torchtop.monitor.model.fmt import ms, pct, plural

if TYPE_CHECKING:
    from torchtop.monitor.diagnosis.facts import Facts
    from torchtop.monitor.model.steps import StepRecord

FURTHER = 10  # the what-if's interval: this many times the measured one


class Saving(NamedTuple):
    """The judged steps' saves."""

    saves: int
    share: float  # their host time / the steps' wall time
    save_ms: float  # mean host ms a save
    interval: float  # steps per save
    step_ms: float  # mean step, saves included
    # the steps just after a save, where slower than the steps' noise (else all 0): how many were
    # compared after each (at most), their median ms, that of the steps far from a save, and the
    # excess a save (ms) and over the judged wall time (share)
    after: int = 0
    after_ms: float = 0.0
    far_ms: float = 0.0
    extra_ms: float = 0.0
    extra_share: float = 0.0

    @property
    def cost_ms(self) -> float:
        """A save in all: its own time and the slowdown of the steps after it."""
        return self.save_ms + self.extra_ms

    @property
    def cost_share(self) -> float:
        """The saves' share of wall time, the slowdown after them included."""
        return min(1.0, self.share + self.extra_share)

    @property
    def base_ms(self) -> float:
        """The mean step without its saves (nor the slowdown after them)."""
        return max(0.0, self.step_ms - self.cost_ms / self.interval) if self.interval > 0 else self.step_ms

    def share_at(self, interval: float) -> float:
        """The saves' share of wall time with one save every `interval` steps."""
        cost = self.cost_ms
        total = interval * self.base_ms + cost
        return cost / total if total > 0 else 0.0


def saving(steps: Sequence[StepRecord]) -> Saving | None:
    """The saves in `steps` (None: none seen)."""
    # a checkpoint is a step with saves: a model's and an optimizer's torch.save, or DCP's async_save
    # and the wait on the one before it, are one checkpoint of the loop's "every N steps"
    saves = sum(1 for s in steps if s.saves)
    wall = sum(s.wall_ns for s in steps)
    if saves <= 0 or wall <= 0:
        return None
    saved = sum(s.saved_ns for s in steps)
    span = sum(_span([s for s in steps if s.rank == r]) for r in {s.rank for s in steps})
    got = Saving(saves, min(1.0, saved / wall), saved / saves / 1e6, span / saves, wall / len(steps) / 1e6)
    return _with_after(got, steps, wall)


def _span(own: Sequence[StepRecord]) -> int:
    """The step numbers one rank's steps cover (a job's are pooled: each rank's counts once)."""
    span = own[-1].i - own[0].i + 1 if own[-1].i >= own[0].i else len(own)
    return max(1, span)


Ms = list[float]


def _split(steps: Sequence[StepRecord], gap: int) -> tuple[list[Ms], list[Ms], int]:
    """One rank's steps (by step number): the ms of the steps just after each save and of those
    far from one, a list for each gap between saves, and the most compared after a save. A save's
    after-steps are the `checkpoint_after_steps` after it, at most half the way to the next save
    (a DCP `.result()` is one), so some steps stay far; the first steps follow a save not seen
    (the interval before the first one): neither."""
    at = [s.i for s in steps if s.saves]
    # where the saves before and after the window would be (at most its first and last step)
    bounds = [min(at[0] - gap, steps[0].i - 1), *at, max(at[-1] + gap, steps[-1].i + 1)]
    after: list[Ms] = []
    far: list[Ms] = []
    most = 0
    by_i = {s.i: s.wall_ns / 1e6 for s in steps if not s.saves}
    for n, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        k = min(int(T.checkpoint_after_steps), (b - a - 1) // 2)
        near = [by_i[i] for i in range(a + 1, a + k + 1) if i in by_i]
        far.append([by_i[i] for i in range(a + k + 1, b) if i in by_i])
        if n > 0 and near:
            after.append(near)
            most = max(most, k)
    return after, [f for f in far if f], most


def _with_after(s: Saving, steps: Sequence[StepRecord], wall: int) -> Saving:
    """`s` with the slowdown of the steps just after its saves: their median against that of the
    steps far from one, above the noise (twice the band, as the straggler's: the spread, gap to
    gap, of the far steps' median) and after most saves. Medians: a pause of the machine's (a
    neighbour, a collection) in a step here or there is not the save's."""
    gap = max(1, round(s.interval))
    after: list[Ms] = []
    far: list[Ms] = []
    most = 0
    for rank in sorted({x.rank for x in steps}):  # a job's pooled steps: each rank's own sequence
        own = sorted((x for x in steps if x.rank == rank), key=lambda x: x.i)
        if any(x.saves for x in own):
            a, f, k = _split(own, gap)
            after += a
            far += f
            most = max(most, k)
    near = [ms for group in after for ms in group]
    if sum(map(len, far)) < 3 or len(near) < 3:
        return s
    base = median(ms for group in far for ms in group)
    band = measure_noise({0: [(n, median(g)) for n, g in enumerate(far)]}, -1, base).band_ms
    slow = sum(1 for group in after if median(group) - base > band)
    typical = median(near)
    if base <= 0 or typical - base <= T.checkpoint_after_bands * band or 2 * slow <= len(after):
        return s
    extra = (typical - base) * len(near)
    return s._replace(
        after=most,
        after_ms=typical,
        far_ms=base,
        extra_ms=extra / len(after),
        extra_share=min(1.0, extra * 1e6 / wall),
    )


def _band(share: float, scale: float) -> Severity | None:
    if share >= T.checkpoint_severe * scale:
        return "critical"
    if share >= T.checkpoint_high * scale:
        return "warning"
    return None


def _every(interval: float) -> str:
    return "every step" if interval <= 1.05 else f"every {interval:.0f} steps"


def rule_checkpoint(f: Facts, scale: float = 1.0) -> Finding | None:
    """Saves take `checkpoint_high` of wall time or more (warning), `checkpoint_severe` (critical)."""
    s = f.checkpoint
    if s is None:
        return None
    severity = _band(s.cost_share, scale)
    if severity is None:
        return None
    saves = f"{s.saves} {plural(s.saves, 'save')}"
    if not s.extra_ms:
        evidence: tuple[str, ...] = (
            f"saving {_every(s.interval)} costs {pct(s.share, 0)} of wall time: "
            f"{saves} of {ms(s.save_ms)} ms each in the judged steps",
        )
        advice = (
            "save less often, or save asynchronously (torch.distributed.checkpoint.async_save)",
            "save only the model's and optimizer's state dicts, to fast local storage",
        )
        return Finding("checkpoint", severity, s.share, evidence, advice)
    slower = (
        f"the {s.after} steps after each save run {times_words(s.after_ms / s.far_ms)} slower "
        f"({ms(s.after_ms)} ms vs {ms(s.far_ms)} ms): the save's background work (async staging, its "
        f"upload) contends with compute; {ms(s.cost_ms)} ms a save in all"
    )
    cost = (
        f"saving {_every(s.interval)} costs {pct(s.cost_share, 0)} of wall time: {saves} of "
        f"{ms(s.save_ms)} ms each in the judged steps and {ms(s.extra_ms)} ms more in the steps after each"
    )
    # the slowdown first where it costs more than the saves themselves
    evidence = (slower, cost) if s.extra_ms > s.save_ms else (cost, slower)
    advice = (
        "upload from a separate process (async_save(..., async_checkpointer_type="
        "AsyncCheckpointerType.PROCESS)): its Python work then takes no time from the training thread's",
        "stage into pinned memory with non-blocking copies (async_stager=DefaultStager("
        "StagingOptions(use_pinned_memory=True, use_non_blocking_copy=True)))",
        "save less often: the slowdown after a save is paid once a save",
    )
    return Finding("checkpoint", severity, s.cost_share, evidence, advice)


def checkpoint_upside(f: Facts) -> Upside | None:
    """Saving FURTHER times less often: the same save (and slowdown after it), the same step
    without one."""
    s = f.checkpoint
    if s is None or s.interval <= 0:
        return None
    later = s.interval * FURTHER
    got = faster("saving less often", s.step_ms, s.base_ms + s.cost_ms / later, "estimate")
    if got is None:
        return None
    text = (
        f"saving {_every(s.interval)} costs {pct(s.cost_share, 0)} of wall time; {_every(later)}: "
        f"{pct(s.share_at(later), 0)} (~{got.speedup:.1f}× steps/s; estimate)"
    )
    return replace(got, text=text)
