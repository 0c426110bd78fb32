"""Which steps a verdict judges when the run is young, slow, or has no training steps, and
what the verdict says while it cannot judge yet.

- A slow run (seconds a step) does not wait for warm-up + `min_steps` steps: once `early_steps`
  steps are seen or the steps seen span `early_s` seconds, the steps past the first one or two
  are judged, and the verdict says its confidence (few steps).
- A loop with no training step but evaluation/inference forwards (no backward, no optimizer) is
  judged on those forward passes, with their latency (p50/p99).
- Steps ended at each backward (no optimizer.step() seen: agent/hooks/probe.py) are said so.
- A data verdict whose wait is the loop resuming a plain generator says so (estimated).
- Nothing judged yet: the line says what is missing and counts down with steps and time.
Pure: state in, steps and lines out.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from torchtop.monitor.diagnosis.facts import THRESHOLDS as T
from torchtop.monitor.diagnosis.facts import Facts, Finding
from torchtop.monitor.model.fmt import pct, plural
from torchtop.monitor.model.hotspots import short_site
from torchtop.monitor.model.state import RunState
from torchtop.monitor.model.steps import StepKind, StepRecord

BACKWARD_NOTE = "steps counted at each backward: no optimizer.step() seen"


class Judged(NamedTuple):
    steps: list[StepRecord]
    kind: StepKind
    early: bool  # judged before warm-up + min_steps steps: the verdict states its confidence


def _of(state: RunState, kind: StepKind) -> list[StepRecord]:
    return [s for s in state.steps if s.kind == kind and not state.why.excluded(s)]


def _span_s(steps: list[StepRecord]) -> float:
    return steps[-1].t0 + steps[-1].wall_ns / 1e9 - steps[0].t0 if steps else 0.0


def early(steps: list[StepRecord]) -> list[StepRecord]:
    """Too few steps for the usual warm-up: past `early_steps` steps or `early_s` seconds of
    them, all but the first (two from five on: compilation, allocator warm-up); else none."""
    n = len(steps)
    if n < 2 or (n < T.early_steps and _span_s(steps) < T.early_s):
        return []
    return steps[1 if n < 5 else 2 :]


def inference(state: RunState) -> Judged | None:
    """No training step held: the evaluation/inference forwards, past warm-up (or early)."""
    if any(s.kind == "train" for s in state.steps):
        return None
    evals = _of(state, "eval")
    warm = int(T.warmup_steps)
    past = [s for s in evals if s.i >= warm] if len(evals) > warm else []
    if len(past) >= T.min_steps:
        recent = state.window(T.window_s, "eval")
        recent = [s for s in recent if s.i >= warm]
        return Judged(
            recent if len(recent) >= T.window_steps else past[-int(T.window_steps) :], "eval", False
        )
    got = early(evals)
    return Judged(got, "eval", True) if got else None


def latency_ms(steps: list[StepRecord]) -> tuple[float, float]:
    """(p50, p99) of the steps' wall times, in ms (nearest rank)."""
    walls = sorted(s.wall_ns / 1e6 for s in steps)
    if not walls:
        return 0.0, 0.0

    def at(q: float) -> float:
        return walls[min(len(walls) - 1, round(q * (len(walls) - 1)))]

    return at(0.5), at(0.99)


def notes(judged: Judged, state: RunState) -> tuple[str, ...]:
    """The verdict's first evidence lines: what the steps are, how sure it is."""
    steps, out = judged.steps, list[str]()
    if judged.kind == "eval":
        p50, p99 = latency_ms(steps)
        out.append(
            f"inference only (no backward, no optimizer step): {len(steps)} forward "
            f"{plural(len(steps), 'pass', 'passes')} judged, "
            f"latency p50 {p50:.1f} ms, p99 {p99:.1f} ms"
        )
    elif any(s.at_backward for s in steps):
        out.append(BACKWARD_NOTE)
    if judged.early:
        seen = sum(1 for s in state.steps if s.kind == judged.kind)
        each = sum(s.wall_ns for s in steps) / len(steps) / 1e9
        sure = "low" if len(steps) < T.min_steps else "moderate"
        out.append(
            f"confidence {sure}: judged on {len(steps)} step{'s' if len(steps) != 1 else ''} of "
            f"{each:.1f} s (of {seen} seen; the first {seen - len(steps)} skipped as warm-up); firmer from "
            f"{int(T.warmup_steps + T.min_steps)} steps"
        )
    return tuple(out)


def waiting(state: RunState) -> str:
    """Why there is no verdict yet, counting down in steps and seconds."""
    train, evals = _of(state, "train"), _of(state, "eval")
    steps = train or evals
    what = "steps" if train or not evals else "forward passes"
    now = state.agent_time
    if not steps:
        since = state.hello.start_time if state.hello is not None else None
        age = f" in {max(0.0, now - since):.0f} s" if since and now else ""
        return (
            f"no training step seen{age}: torchtop ends a step at optimizer.step(), at each backward when "
            "no optimizer steps, or at each root module's forward in an eval loop; if your loop has none "
            "of these, wrap each iteration: `with torchtop.agent.step(): ...`"
        )
    n = len(steps)
    each = _span_s(steps) / n
    ran = max(_span_s(steps), now - steps[0].t0 if now else 0.0)
    left_s = T.early_s - ran
    if left_s <= 0:
        left = "when the one running now ends"
    else:
        left = f"after {max(1, int(T.early_steps) - n)} more or in ~{left_s:.0f} s"
    return f"{n} {what} seen ({each:.2f} s each, {ran:.0f} s so far): a first verdict {left}"


def judged(state: RunState, usual: list[StepRecord]) -> Judged | None:
    """The steps to judge: `usual` (past warm-up) when there are enough, else early ones of a
    slow run, else an inference loop's forwards; None: not yet."""
    if len(usual) >= T.min_steps:
        return Judged(usual, "train", False)
    got = early(_of(state, "train"))
    if got:
        return Judged(got, "train", True)
    return inference(state)


def with_notes(verdict: Finding, judged: Judged, state: RunState) -> Finding:
    """The verdict with what its steps are and how sure it is, after its first line."""
    lines = notes(judged, state)
    head, rest = verdict.evidence[:1], verdict.evidence[1:]
    return replace(verdict, evidence=(*head, *lines, *rest)) if lines else verdict


def with_input_wait_note(verdict: Finding, f: Facts) -> Finding:
    """A data verdict whose wait is (partly) the loop resuming a plain generator says so: that
    share is estimated from stack samples, which `torchtop.agent.data()` would time exactly."""
    if verdict.kind != "data-loading" or not f.input_wait or f.why is None:
        return verdict
    sites = f.why.fold.input_sites
    where = f" ({short_site(sites[0].site)})" if sites and sites[0].site else ""
    line = (
        f"{pct(f.input_wait, 0)} of the step is the loop resuming its input generator{where}: "
        "estimated from stack samples; `torchtop.agent.data(gen)` (in the `for`, or pulled with next()) "
        "times it exactly"
    )
    return replace(verdict, evidence=(*verdict.evidence[:1], line, *verdict.evidence[1:]))
