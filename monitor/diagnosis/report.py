"""`torchtop report`: one JSON object about the last S seconds of a run. Pure: state in, a
RunReport (report_types.py) out; build_report encodes it as the JSON `torchtop report` prints."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import msgspec

from torchtop.monitor.diagnosis import warmup
from torchtop.monitor.diagnosis.diagnose import diagnose
from torchtop.monitor.diagnosis.facts import Diagnosis, Finding
from torchtop.monitor.diagnosis.oom import OomForecast, limit_of
from torchtop.monitor.diagnosis.report_types import (
    AgentRefused,
    EvalLatency,
    GpuSection,
    HostSection,
    MemoryDevice,
    MemorySection,
    OomForecastReport,
    RunReport,
    StepTimeMs,
)
from torchtop.monitor.diagnosis.why import why_report
from torchtop.monitor.diagnosis.window import Window, choose
from torchtop.monitor.model.energy import rounded, window_energy
from torchtop.monitor.model.state import (
    RunState,
    device_ms,
    retry_rate,
    timed,
)


def build_report(
    state: RunState, seconds: float, target: str = "", window: float | None = None, widen: bool = False
) -> dict[str, Any]:
    """The report as JSON-able data: what `torchtop report` prints (run_report, encoded)."""
    return msgspec.to_builtins(run_report(state, seconds, target, window, widen))


def run_report(
    state: RunState,
    seconds: float,
    target: str = "",
    window: float | None = None,
    widen: bool = False,
    chosen: Window | None = None,
    previous: Diagnosis | None = None,
    judged: Diagnosis | None = None,
) -> RunReport:
    """`previous`: the verdict in force (a live exporter's: hysteresis). `window` (default `seconds`) is how far back the figures reach on the agent's clock; the
    verdict, the breakdown and the hot spots read the same steps (window.py: too few reach back to
    the ones the verdict judges, said in a line where `widen`). `chosen`: that window, if chosen."""
    span = seconds if window is None else window
    history = span != seconds
    w = choose(state, span) if chosen is None else chosen
    summary = w.summary
    steps = w.steps
    stats = summary.stats
    timed_steps = timed(summary.in_full)  # the counts are the span's; the figures the judged steps'
    hello = state.hello
    why = why_report(state, steps, w.why)
    memory, gpu, host = telemetry_report(state, seconds)
    # `judged`: the caller's diagnosis of this window (the exporter's, a job rank's): not made twice
    diagnosis = diagnose(state, previous, window=w) if judged is None else judged
    p50, p99 = warmup.latency_ms(summary.evals)
    report = RunReport(
        target=target,
        seconds=seconds,
        history=history,
        # every training step in the window is counted (`steps`) over `covered_s` of agent
        # time; `steps_in_full` of them are kept whole, and the breakdown, phase and device
        # times are theirs. `thinned`: not every step was kept whole (a window of more steps
        # than the monitor keeps, the agent's thinned history before it joined, lost batches)
        covered_s=round(summary.covered_s, 3),
        run_id=state.run_id,
        pid=hello.pid if hello else None,
        hostname=hello.host if hello else None,
        device=hello.device if hello else "cpu",
        device_name=hello.device_name if hello else "",
        ranks=sorted({s.rank for s in steps} or ({hello.rank} if hello else set[int]())),
        steps=summary.steps,
        steps_in_full=len(summary.in_full),
        thinned=summary.thinned,
        eval_steps=len(summary.evals),
        # each eval step is one forward pass (an inference loop's latency): p50 / p99 of their wall times
        eval_latency_ms=EvalLatency(_r4(p50), _r4(p99)) if summary.evals else None,
        # phases (and micro-batches) are timed on every step of 10 ms or more, on a random
        # sample of faster ones: `timed_steps` of `steps_in_full`
        timed_steps=len(timed_steps),
        micro_batches=(sum(s.micro for s in timed_steps) / len(timed_steps)) if timed_steps else 0.0,
        step_time_ms=StepTimeMs(*(round(stats[f"{k}_ms"], 4) for k in ("median", "p90", "mean"))),
        steps_per_s=round(stats["steps_per_s"], 3),
        # a plain generator the loop resumes is data wait (estimated from stack samples)
        breakdown={k: round(v, 5) for k, v in w.breakdown().items()},
        phase_ms={k: round(v, 4) for k, v in w.phase_ms().items()},  # data as in the breakdown
        device_ms={k: round(v, 4) for k, v in device_ms(steps).items()},
        batches=state.batches,
        dropped=state.dropped,
        gaps=state.gaps,
        bad_frames=state.bad_frames,
        hook_errors=state.hook_errors,
        agent_refused=AgentRefused(bad=state.bad_requests, dropped=state.dropped_requests),
        memory=memory,
        gpu=gpu,
        host=host,
        sync=why.sync,
        stack_samples=why.stack_samples,
        hot_frames=why.hot_frames,
        hot_functions=why.hot_functions,
        throughput=why.throughput,
        energy=rounded(window_energy(state.points, steps, summary)),
        memory_limit_bytes=limit_of(state.telemetry)[0] or None,
    )
    if widen and w.line:
        diagnosis = replace(diagnosis, verdict=with_line(diagnosis.verdict, w.line))
    return with_diagnosis(report, diagnosis)


def with_line(verdict: Finding, line: str) -> Finding:
    """The verdict with `line` after its first evidence line."""
    return replace(verdict, evidence=(*verdict.evidence[:1], line, *verdict.evidence[1:]))


def with_diagnosis(report: RunReport, diagnosis: Diagnosis) -> RunReport:
    """The report with `diagnosis`'s verdict and flags (a rank of a job carries the job's)."""
    report.verdict = diagnosis.verdict.to_report()
    report.flags = [f.kind for f in diagnosis.flags]
    report.flag_details = [f.to_report() for f in diagnosis.flags]
    report.oom_forecast = oom_report(diagnosis.oom)
    return report


def oom_report(o: OomForecast | None) -> OomForecastReport | None:
    if o is None:
        return None
    return OomForecastReport(
        steps=int(o.steps),
        seconds=round(o.seconds, 1),
        limit_bytes=o.limit,
        limit_from=o.limit_from,
        rate_bytes_per_step=round(o.rate, 1),
        in_use_bytes=int(o.level),
        confidence=o.confidence,
        text=o.text(),
    )


def _r4(x: float) -> float:
    return round(x, 4)


def telemetry_report(state: RunState, seconds: float) -> tuple[MemorySection, GpuSection, HostSection]:
    """`memory`, `gpu` and `host` sections: the latest samples, peaks, and why a part is missing."""
    tel = state.telemetry
    unavailable = (
        dict(tel.unavailable)
        if tel
        else {
            "memory": "no telemetry received",
            "gpu": "no telemetry received",
            "host": "no telemetry received",
        }
    )
    if tel and tel.memory:
        devices: list[MemoryDevice] = []
        for m in tel.memory:
            frag = next((f for f in tel.frag if f.device == m.device), None)
            devices.append(
                MemoryDevice(
                    **{k: getattr(m, k) for k in m.__struct_fields__},
                    window_peak_max=state.peak_window.get(m.device, m.window_peak),
                    rounding_waste=max(0, m.allocated - m.requested),
                    reserved_fraction=m.reserved / m.device_total if m.device_total else None,
                    fragmentation=frag,
                )
            )
        first = devices[0]
        memory = MemorySection(
            available=True,
            devices=devices,
            alloc_retries_per_s=round(retry_rate(state, seconds), 4),
            allocated=first.allocated,
            reserved=first.reserved,
            peak_allocated=first.peak_allocated,
            inactive_split=first.inactive_split,
            alloc_retries=first.alloc_retries,
            ooms=first.ooms,
        )
    else:
        memory = MemorySection(available=False, reason=unavailable.get("memory", ""))
    if tel and tel.gpus:
        gpu = GpuSection(available=True, devices=list(tel.gpus))
    else:
        gpu = GpuSection(available=False, reason=unavailable.get("gpu", ""))
    if tel and tel.host:
        h = tel.host
        sent: dict[str, Any] = msgspec.to_builtins(h)  # the fields its encoding has
        host = HostSection(
            available=True, **{k: getattr(h, k) for k in sent if k != "workers"}, workers=h.workers
        )
    else:
        host = HostSection(available=False, reason=unavailable.get("host", ""))
    return memory, gpu, host
