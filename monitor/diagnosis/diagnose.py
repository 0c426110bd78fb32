"""Reduce a RunState to `Facts` and run every diagnosis rule over them. Pure: no textual, no zmq."""

from __future__ import annotations

from statistics import mean

from torchtop.monitor.diagnosis import warmup
from torchtop.monitor.diagnosis.checkpoint import saving
from torchtop.monitor.diagnosis.facts import THRESHOLDS as T
from torchtop.monitor.diagnosis.facts import Diagnosis, Facts, Finding
from torchtop.monitor.diagnosis.gpm import figures as gpm_figures
from torchtop.monitor.diagnosis.growth import leak_growth
from torchtop.monitor.diagnosis.oom import forecast, limit_of
from torchtop.monitor.diagnosis.selection import flags_of, primary, with_upsides
from torchtop.monitor.diagnosis.stall import run_stall, with_resumed
from torchtop.monitor.diagnosis.why import WhyFacts, why_facts
from torchtop.monitor.diagnosis.window import Window, choose
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


def facts(state: RunState, steps: list[StepRecord], why: WhyFacts | None = None) -> Facts:
    """The figures the rules read, over `steps`; `why`: their stack samples already folded."""
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
    g = f.growth
    rate = 1000.0 / f.step_ms if f.step_ms > 0 else (g.span_steps / g.span_s if g and g.span_s > 0 else 0.0)
    f.oom = forecast(g, rate, *limit_of(tel), peak=float(f.window_peak) if cuda else 0.0)
    if tel is not None and tel.gpus:
        f.gpm = gpm_figures(tel.gpus[0])
    f.why = why if why is not None else why_facts(state, steps, f.gpu_util)
    f.stall = run_stall(state)
    f.checkpoint = saving(steps)
    # a plain generator the loop resumes from its `for`: data wait no hook timed (stack samples)
    f.shares, moved = with_input_wait(f.shares, f.why.fold, int(T.min_phase_samples))
    f.input_wait = moved
    if moved:
        f.ms = dict(f.ms, data=f.ms.get("data", 0.0) + moved * f.step_ms)
        f.ms["other"] = max(0.0, f.ms.get("other", 0.0) - moved * f.step_ms)
    return f


def diagnose(
    state: RunState,
    previous: Diagnosis | None = None,
    steps: list[StepRecord] | None = None,
    window: Window | None = None,
) -> Diagnosis:
    """The verdict and flags for `window` (chosen here when not given: the live span); `previous`
    gives the verdict hysteresis. `steps`: judge these (a job's ranks' own, pooled) instead."""
    if window is None or steps is not None:
        window = choose(state, steps=steps)
    judged = window.judged
    if judged is None:
        return Diagnosis(Finding("unknown", "ok", 0.0, (warmup.waiting(state),)), (), 0)
    steps = judged.steps
    f = facts(state, steps, window.why)
    f.inference = judged.kind == "eval"
    verdict = warmup.with_notes(primary(f, previous.verdict.kind if previous else None), judged, state)
    verdict = with_resumed(warmup.with_input_wait_note(verdict, f), f)
    flags = flags_of(f)
    return with_upsides(Diagnosis(verdict, flags, len(steps), f.step_ms, f.oom, inference=f.inference), f)
