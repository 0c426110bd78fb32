"""The window a refresh judges, chosen once: the verdict, every panel, the report and the
exporter read its steps, its span and its one fold of the stack samples.

The asked span (10 s live, `--seconds S` in a report, the whole history) reaches back further
when the steps it holds are too few to judge: to the last `window_steps` steps past warm-up, or,
on steps longer than the span, to the steps the verdict can see ("judged on 2 steps of 11 s").
The panels then show that span, not the asked one, so a step time on screen and the verdict's
"A ms of B ms" are figures of the same steps. Pure: state in, a Window out.
"""

from __future__ import annotations

import math
from statistics import mean
from typing import NamedTuple

from torchtop.monitor.diagnosis import warmup
from torchtop.monitor.diagnosis.facts import THRESHOLDS as T
from torchtop.monitor.diagnosis.why import WhyFacts, why_facts
from torchtop.monitor.model.fmt import plural
from torchtop.monitor.model.hotspots import with_input_wait
from torchtop.monitor.model.job_state import JobState
from torchtop.monitor.model.state import RunState, Summary, breakdown, phase_ms, recent_points
from torchtop.monitor.model.steps import StepRecord

WINDOW_S = T.window_s  # the live views' span: one definition for the TUI, the job view and export


class Window(NamedTuple):
    asked: float  # the span asked for, in seconds of agent time (inf: the whole history)
    seconds: float  # the span it reaches back: `asked`, or wider to the judged steps
    summary: Summary  # every step counted over `seconds`; its in_full kept whole
    judged: warmup.Judged | None  # the steps the verdict judges; None: too few yet
    why: WhyFacts  # the stack samples folded once over `steps`, the throughput of those steps
    gpu_util: float | None  # NVML's mean utilisation over `seconds`
    line: str  # why it reaches further than asked ("": it does not, or not worth a line)

    @property
    def steps(self) -> list[StepRecord]:
        """The steps every figure reads: the judged ones, else the span's whole training steps."""
        return self.judged.steps if self.judged is not None else self.summary.in_full

    def breakdown(self) -> dict[str, float]:
        """Each phase's share of `steps`, a plain generator's resumption moved to data wait (the
        stack samples' estimate): the panel's, the report's and the verdict's shares."""
        return with_input_wait(breakdown(self.steps), self.why.fold, int(T.min_phase_samples))[0]

    def phase_ms(self) -> dict[str, float]:
        """Each phase's host ms a step over `steps`, the generator's resumption moved from `other`
        to `data` as in `breakdown` (the same split in ms as in shares)."""
        ms = phase_ms(self.steps)
        shares = breakdown(self.steps)
        other = shares.get("other", 0.0)
        moved = with_input_wait(shares, self.why.fold, int(T.min_phase_samples))[1]
        if moved > 0 and other > 0 and "other" in ms:
            part = ms["other"] * min(1.0, moved / other)
            ms["data"] = ms.get("data", 0.0) + part
            ms["other"] -= part
        return ms


def judged_steps(state: RunState, seconds: float = T.window_s) -> list[StepRecord]:
    """Training steps past warm-up: the last `seconds` or `window_steps` steps, the longer."""
    warm = int(T.warmup_steps)
    recent = [s for s in state.window(seconds) if s.i >= warm]
    if len(recent) >= T.window_steps:
        return recent
    train = [s for s in state.steps if s.kind == "train" and s.i >= warm and not state.why.excluded(s)]
    return train[-int(T.window_steps) :]


POOLED_RANKS = 16  # a job of more ranks pools an even spread of this many (a refresh stays cheap)


def pooled_steps(states: list[RunState], seconds: float = T.window_s) -> list[StepRecord]:
    """Each state's judged steps, together in order of time: a job's ranks judged over the
    same steps their own lines read."""
    held = [st for st in states if st.steps]
    if len(held) > POOLED_RANKS:
        held = [held[k * len(held) // POOLED_RANKS] for k in range(POOLED_RANKS)]
    return sorted((s for st in held for s in judged_steps(st, seconds)), key=lambda s: s.t0)


def job_window(job: JobState, seconds: float = T.window_s) -> Window:
    """A job's window: its running ranks' own judged steps, pooled, over the same span."""
    return choose(job.job, seconds, pooled_steps([m.state for m in job.live()], seconds) or None)


def choose(state: RunState, seconds: float = T.window_s, steps: list[StepRecord] | None = None) -> Window:
    """The window over the last `seconds` of agent time; `steps`: judge these instead (a job's
    ranks' own, pooled), the span reaching back to the first of them."""
    judged = warmup.judged(state, judged_steps(state, seconds) if steps is None else steps)
    reach, line = seconds, ""
    if judged is not None and judged.steps and not math.isinf(seconds):
        back = state.agent_time - judged.steps[0].t0 - 1e-6  # from its start: the one before ended by then
        if back > seconds:
            reach = back
            each = sum(s.wall_ns for s in judged.steps) / len(judged.steps) / 1e9
            # steps too long for the span, not a span with none ending in it (a stall: stall.py)
            if judged.kind == "train" and len(state.window(seconds)) < 2 and each > seconds / 2:
                line = _slow_line(len(judged.steps), each, seconds, reach)
    summary = state.summary(reach)
    chosen = judged.steps if judged is not None else summary.in_full
    utils = [p.gpu_util for p in recent_points(state, max(reach, 1.0)) if p.gpu_util is not None]
    util = mean(utils) if utils else None
    return Window(seconds, reach, summary, judged, why_facts(state, chosen, util), util, line)


def _slow_line(n: int, each: float, asked: float, reach: float) -> str:
    return (
        f"judged on {n} {plural(n, 'step')} of {each:.1f} s: steps longer than the {asked:g} s "
        f"asked, so the window widened to the last {reach:.0f} s"
    )
