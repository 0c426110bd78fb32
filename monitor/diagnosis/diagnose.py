"""Reduce a RunState to `Facts` and run every diagnosis rule over them. Pure: no textual, no zmq."""

from __future__ import annotations

from statistics import mean

from torchtop.monitor.diagnosis import warmup
from torchtop.monitor.diagnosis.facts import THRESHOLDS as T
from torchtop.monitor.diagnosis.facts import Diagnosis, Facts, Finding
from torchtop.monitor.diagnosis.gpm import figures as gpm_figures
from torchtop.monitor.diagnosis.growth import leak_growth
from torchtop.monitor.diagnosis.selection import flags_of, primary, with_upsides
from torchtop.monitor.diagnosis.why import why_facts
from torchtop.monitor.model.hotspots import with_input_wait
from torchtop.monitor.model.state import (
    RunState,
    breakdown,
    device_ms,
    phase_ms,
    recent_points,
    retry_rate,
)
from torchtop.monitor.model.steps import StepRecord


def judged_steps(state: RunState) -> list[StepRecord]:
    """Training steps past warm-up: the last `window_s` seconds or `window_steps` steps, the longer."""
    warm = int(T.warmup_steps)
    recent = [s for s in state.window(T.window_s) if s.i >= warm]
    if len(recent) >= T.window_steps:
        return recent
    train = [s for s in state.steps if s.kind == "train" and s.i >= warm and not state.why.excluded(s)]
    return train[-int(T.window_steps) :]


def facts(state: RunState, steps: list[StepRecord]) -> Facts:
    hello = state.hello
    device = hello.device if hello else "cpu"
    step_ms = sum(s.wall_ns for s in steps) / len(steps) / 1e6 if steps else 0.0
    shares = breakdown(steps)
    # each phase's share of the mean step, so "X% of step time: A ms of B ms" adds up even where
    # the timed steps (phase sampling) are not the untimed ones' length
    ms = {k: v * step_ms for k, v in shares.items()} if any(shares.values()) else phase_ms(steps)
    f = Facts(
        steps=len(steps),
        step_ms=step_ms,
        shares=shares,
        ms=ms,
        device=device,
        device_ms=device_ms(steps),
    )
    span = (steps[-1].t0 - steps[0].t0) if len(steps) > 1 else T.window_s
    window = max(span, 1.0)
    pts = recent_points(state, window)
    utils = [p.gpu_util for p in pts if p.gpu_util is not None]
    f.gpu_util = mean(utils) if utils else None
    cpus = [p.proc_cpu for p in pts if p.proc_cpu is not None]
    f.proc_cpu = mean(cpus) if cpus else None
    tel = state.telemetry
    if tel is not None and tel.host is not None:
        f.cores = tel.host.cpu_count
        workers = [w for w in tel.host.workers if w.dataloader]
        # a Python child not yet named pt_data_worker may be a worker starting (spawn imports
        # first): how many there are is not known then, never "none"
        starting = not workers and any(w.name.startswith("python") for w in tel.host.workers)
        f.workers = None if starting else len(workers)
        f.worker_cpu = mean(w.cpu_percent for w in workers) if workers else None
        waits = [w.wait_percent for w in workers if w.wait_percent is not None]
        f.worker_wait = mean(waits) if waits and len(waits) == len(workers) else None
    if tel is not None and tel.memory:
        m = tel.memory[0]
        f.mem_total, f.reserved, f.allocated = m.device_total, m.reserved, m.allocated
        f.window_peak = state.peak_window.get(m.device, m.window_peak)
        f.inactive_split, f.ooms = m.inactive_split, m.ooms
        f.retry_rate = retry_rate(state, window)
        frag = next((x for x in tel.frag if x.device == m.device), None)
        if frag is not None:
            f.frag_external, f.frag_free, f.expandable = frag.external, frag.total_free, frag.expandable
    # memory growth is judged over a longer horizon than the verdict, but never over warm-up
    cuda = bool(tel and tel.memory)
    f.growth = leak_growth(state, cuda, f.step_ms / 1000.0)
    f.growth_what = "allocated CUDA memory" if cuda else "process RSS"
    if tel is not None and tel.gpus:
        f.gpm = gpm_figures(tel.gpus[0])
    f.why = why_facts(state, steps, f.gpu_util)
    # a plain generator the loop resumes from its `for`: data wait no hook timed (stack samples)
    f.shares, moved = with_input_wait(f.shares, f.why.fold, int(T.min_phase_samples))
    f.input_wait = moved
    if moved:
        f.ms = dict(f.ms, data=f.ms.get("data", 0.0) + moved * f.step_ms)
        f.ms["other"] = max(0.0, f.ms.get("other", 0.0) - moved * f.step_ms)
    return f


POOLED_RANKS = 16  # a job of more ranks pools an even spread of this many (a refresh stays cheap)


def pooled_steps(states: list[RunState]) -> list[StepRecord]:
    """Each state's judged steps, together in order of time: a job's ranks judged over the
    same steps their own lines read."""
    held = [st for st in states if st.steps]
    if len(held) > POOLED_RANKS:
        held = [held[k * len(held) // POOLED_RANKS] for k in range(POOLED_RANKS)]
    return sorted((s for st in held for s in judged_steps(st)), key=lambda s: s.t0)


def diagnose(
    state: RunState, previous: Diagnosis | None = None, steps: list[StepRecord] | None = None
) -> Diagnosis:
    """The verdict and flags for the recent window; `previous` gives the verdict hysteresis.
    `steps`: judge these (a job's ranks' own, pooled) instead of the state's recent window."""
    judged = warmup.judged(state, judged_steps(state) if steps is None else steps)
    if judged is None:
        return Diagnosis(Finding("unknown", "ok", 0.0, (warmup.waiting(state),)), (), 0)
    steps = judged.steps
    f = facts(state, steps)
    verdict = warmup.with_notes(primary(f, previous.verdict.kind if previous else None), judged, state)
    verdict = warmup.with_input_wait_note(verdict, f)
    flags = flags_of(f)
    return with_upsides(Diagnosis(verdict, flags, len(steps), f.step_ms), f)
