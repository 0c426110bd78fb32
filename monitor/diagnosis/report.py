"""`torchtop report`: one JSON object about the last S seconds of a run. Pure: state in, dict out."""

from __future__ import annotations

from typing import Any

import msgspec

from torchtop.monitor.diagnosis.diagnose import diagnose
from torchtop.monitor.diagnosis.facts import THRESHOLDS as T
from torchtop.monitor.diagnosis.warmup import latency_ms
from torchtop.monitor.diagnosis.why import why_report
from torchtop.monitor.model.hotspots import fold, with_input_wait
from torchtop.monitor.model.state import (
    RunState,
    breakdown,
    device_ms,
    phase_ms,
    retry_rate,
    timed,
)
from torchtop.monitor.model.steps import StepRecord


def build_report(
    state: RunState, seconds: float, target: str = "", window: float | None = None
) -> dict[str, Any]:
    """`window` (default `seconds`) is how far back the figures reach on the agent's clock."""
    window = seconds if window is None else window
    summary = state.summary(window)
    steps = summary.in_full
    stats = summary.stats
    timed_steps = timed(steps)
    hello = state.hello
    return (
        {
            "target": target,
            "seconds": seconds,
            "history": window != seconds,
            # every training step in the window is counted (`steps`) over `covered_s` of agent
            # time; `steps_in_full` of them are kept whole, and the breakdown, phase and device
            # times are theirs. `thinned`: not every step was kept whole (a window of more steps
            # than the monitor keeps, the agent's thinned history before it joined, lost batches)
            "covered_s": round(summary.covered_s, 3),
            "run_id": state.run_id,
            "pid": hello.pid if hello else None,
            "hostname": hello.host if hello else None,
            "device": hello.device if hello else "cpu",
            "device_name": hello.device_name if hello else "",
            "ranks": sorted({s.rank for s in steps} or ({hello.rank} if hello else set())),
            "steps": summary.steps,
            "steps_in_full": len(steps),
            "thinned": summary.thinned,
            "eval_steps": len(summary.evals),
            # each eval step is one forward pass (an inference loop's latency): p50 / p99 of their wall times
            "eval_latency_ms": dict(zip(("p50", "p99"), map(_r4, latency_ms(summary.evals))))
            if summary.evals
            else None,
            # phases (and micro-batches) are timed on every step of 10 ms or more, on a random
            # sample of faster ones: `timed_steps` of `steps_in_full`
            "timed_steps": len(timed_steps),
            "micro_batches": (sum(s.micro for s in timed_steps) / len(timed_steps)) if timed_steps else 0.0,
            "step_time_ms": {k: round(stats[f"{k}_ms"], 4) for k in ("median", "p90", "mean")},
            "steps_per_s": round(stats["steps_per_s"], 3),
            # a plain generator the loop resumes is data wait (estimated from stack samples)
            "breakdown": {k: round(v, 5) for k, v in _breakdown(state, steps).items()},
            "phase_ms": {k: round(v, 4) for k, v in phase_ms(steps).items()},
            "device_ms": {k: round(v, 4) for k, v in device_ms(steps).items()},
            "batches": state.batches,
            "dropped": state.dropped,
            "gaps": state.gaps,
            "bad_frames": state.bad_frames,
            "hook_errors": state.hook_errors,
            "agent_refused": {"bad": state.bad_requests, "dropped": state.dropped_requests},
        }
        | telemetry_report(state, seconds)
        | why_report(state, steps, seconds)
        | diagnose(state).to_json()
    )


def _r4(x: float) -> float:
    return round(x, 4)


def _breakdown(state: RunState, steps: list[StepRecord]) -> dict[str, float]:
    return with_input_wait(breakdown(steps), fold(state.why.samples, steps), int(T["min_phase_samples"]))[0]


def telemetry_report(state: RunState, seconds: float) -> dict[str, Any]:
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
    memory: dict[str, Any] = {"available": bool(tel and tel.memory)}
    if tel and tel.memory:
        devices: list[dict[str, Any]] = []
        for m in tel.memory:
            d = msgspec.to_builtins(m)
            d["window_peak_max"] = state.peak_window.get(m.device, m.window_peak)
            d["rounding_waste"] = max(0, m.allocated - m.requested)
            d["reserved_fraction"] = m.reserved / m.device_total if m.device_total else None
            frag = next((f for f in tel.frag if f.device == m.device), None)
            d["fragmentation"] = msgspec.to_builtins(frag) if frag else None
            devices.append(d)
        memory |= {"devices": devices, "alloc_retries_per_s": round(retry_rate(state, seconds), 4)}
        memory |= {
            k: devices[0][k]
            for k in ("allocated", "reserved", "peak_allocated", "inactive_split", "alloc_retries", "ooms")
        }
    else:
        memory["reason"] = unavailable.get("memory", "")
    gpu: dict[str, Any] = {"available": bool(tel and tel.gpus)}
    if tel and tel.gpus:
        gpu["devices"] = [msgspec.to_builtins(g) for g in tel.gpus]
    else:
        gpu["reason"] = unavailable.get("gpu", "")
    host: dict[str, Any] = {"available": bool(tel and tel.host)}
    if tel and tel.host:
        host |= msgspec.to_builtins(tel.host)
        host.setdefault("workers", [])
    else:
        host["reason"] = unavailable.get("host", "")
    return {"memory": memory, "gpu": gpu, "host": host}
