"""Saves as a bottleneck: the `checkpoint` verdict and its what-if at a longer save interval.

A save (torch.save, DCP's save and async staging and wait, safetensors: agent/hooks/checkpoint.py)
is the `checkpoint` phase of the step it runs in; each step also carries its saves and their
time whether its phases were timed or not (phase sampling), so the share here is over every
judged step. The interval is the judged steps per save; the what-if moves saves 10x further apart
with the same cost a save and the same step without one. Pure: no textual, no zmq, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple

from torchtop.monitor.diagnosis.facts import THRESHOLDS as T
from torchtop.monitor.diagnosis.facts import Finding, Severity
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

    @property
    def base_ms(self) -> float:
        """The mean step without its saves."""
        return max(0.0, self.step_ms - self.save_ms / self.interval) if self.interval > 0 else self.step_ms

    def share_at(self, interval: float) -> float:
        """The saves' share of wall time with one save every `interval` steps."""
        cost = self.save_ms
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
    span = steps[-1].i - steps[0].i + 1 if steps[-1].i >= steps[0].i else len(steps)
    return Saving(
        saves, min(1.0, saved / wall), saved / saves / 1e6, max(1, span) / saves, wall / len(steps) / 1e6
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
    severity = _band(s.share, scale)
    if severity is None:
        return None
    evidence = (
        f"saving {_every(s.interval)} costs {pct(s.share, 0)} of wall time: "
        f"{s.saves} {plural(s.saves, 'save')} of {ms(s.save_ms)} each in the judged steps",
    )
    advice = (
        "save less often, or save asynchronously (torch.distributed.checkpoint.async_save)",
        "save only the model's and optimizer's state dicts, to fast local storage",
    )
    return Finding("checkpoint", severity, s.share, evidence, advice)


def checkpoint_upside(f: Facts) -> Upside | None:
    """Saving FURTHER times less often: the same save, the same step without one."""
    s = f.checkpoint
    if s is None or s.interval <= 0:
        return None
    later = s.interval * FURTHER
    got = faster("saving less often", s.step_ms, s.base_ms + s.save_ms / later, "estimate")
    if got is None:
        return None
    text = (
        f"saving {_every(s.interval)} costs {pct(s.share, 0)} of wall time; {_every(later)}: "
        f"{pct(s.share_at(later), 0)} (~{got.speedup:.1f}× steps/s; estimate)"
    )
    return replace(got, text=text)
