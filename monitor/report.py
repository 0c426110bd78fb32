"""`torchtop report`: one JSON object about the last S seconds of a run. Pure: state in, dict out."""

from __future__ import annotations

from typing import Any

from .state import RunState, breakdown, device_ms, phase_ms, step_stats


def build_report(state: RunState, seconds: float, target: str = "") -> dict[str, Any]:
    steps = state.window(seconds)
    evals = state.window(seconds, kind="eval")
    stats = step_stats(steps)
    hello = state.hello
    return {
        "target": target,
        "seconds": seconds,
        "run_id": state.run_id,
        "pid": hello.pid if hello else None,
        "host": hello.host if hello else None,
        "device": hello.device if hello else "cpu",
        "device_name": hello.device_name if hello else "",
        "ranks": sorted({s.rank for s in steps} or ({hello.rank} if hello else set())),
        "steps": len(steps),
        "eval_steps": len(evals),
        "micro_batches": (sum(s.micro for s in steps) / len(steps)) if steps else 0.0,
        "step_time_ms": {k: round(stats[f"{k}_ms"], 4) for k in ("median", "p90", "mean")},
        "steps_per_s": round(stats["steps_per_s"], 3),
        "breakdown": {k: round(v, 5) for k, v in breakdown(steps).items()},
        "phase_ms": {k: round(v, 4) for k, v in phase_ms(steps).items()},
        "device_ms": {k: round(v, 4) for k, v in device_ms(steps).items()},
        "batches": state.batches,
        "dropped": state.dropped,
        "gaps": state.gaps,
        "bad_frames": state.bad_frames,
        "hook_errors": state.hook_errors,
    }
