# pyright: basic
# basic, not strict: reads the report as a dict until the report is typed
"""`torchtop compare`: runs side by side, each against the first. Pure: reports in, rows out.

Each run is summed up by its report (diagnosis/report.py, over the run past warm-up); a row
holds one figure of every run and, for each run after the first, its change against the first
and whether that is better or worse (steps/s: higher is better; times and memory: lower).
Changes under NOISE are called "same": a run's own step times swing by that much.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from torchtop.agent.contract.logcodes import PHASES
from torchtop.monitor.model import fmt

Better = Literal["higher", "lower"]
NOISE = 0.02  # relative changes smaller than this are "same"
THIN_STEPS = 20  # a run with fewer steps to compare: its ratios are said to rest on thin data


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    unit: Literal["ms", "/s", "bytes", "share", "ratio"]
    better: Better | None
    get: Callable[[dict[str, Any]], float | None]


def _path(*keys: str) -> Callable[[dict[str, Any]], float | None]:
    def get(report: dict[str, Any]) -> float | None:
        value: Any = report
        for k in keys:
            if not isinstance(value, dict) or k not in value:
                return None
            value = value[k]
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    return get


def memory_peak(report: dict[str, Any]) -> tuple[float | None, str]:
    """The run's memory peak and what it is: the CUDA allocator's peak (largest device), else
    the training process's peak RSS (its whole memory: the only peak a CPU run has)."""
    devices = report.get("memory", {}).get("devices") or []
    peaks = [d.get("peak_allocated", 0) for d in devices if d.get("peak_allocated")]
    if peaks:
        return float(max(peaks)), "CUDA peak allocated"
    host = report.get("host", {})
    peak = host.get("proc_rss_peak") or host.get("proc_rss")
    return (float(peak), "peak RSS") if peak else (None, "")


def mfu(report: dict[str, Any]) -> float | None:
    """Model FLOPs utilisation, where the report knows it (the run's FLOPs and the device's peak)."""
    for keys in (("mfu",), ("throughput", "mfu"), ("why", "mfu")):
        value = _path(*keys)(report)
        if value is not None:
            return value
    return None


METRICS: tuple[Metric, ...] = (
    Metric("steps_per_s", "steps/s", "/s", "higher", _path("steps_per_s")),
    Metric("step_time.median", "step time median", "ms", "lower", _path("step_time_ms", "median")),
    Metric("step_time.p90", "step time p90", "ms", "lower", _path("step_time_ms", "p90")),
    *(Metric(f"phase.{p}", f"  {p}", "ms", "lower", _path("phase_ms", p)) for p in PHASES),
    *(Metric(f"share.{p}", f"  {p} share", "share", None, _path("breakdown", p)) for p in PHASES),
    Metric("memory_peak", "memory peak", "bytes", "lower", lambda r: memory_peak(r)[0]),
    # where the report carries throughput (samples, tokens, FLOPs: the `throughput` section)
    Metric("samples_per_s", "samples/s", "/s", "higher", _path("throughput", "samples_per_s")),
    Metric("tokens_per_s", "tokens/s", "/s", "higher", _path("throughput", "tokens_per_s")),
    Metric("tflops", "achieved TFLOP/s", "/s", "higher", _path("throughput", "achieved_tflops")),
    Metric("mfu", "MFU", "ratio", "higher", mfu),
)


@dataclass
class Row:
    key: str
    label: str
    unit: str
    better: Better | None
    values: list[float | None]
    changes: list[dict[str, Any] | None] = field(
        default_factory=list[dict[str, Any] | None]
    )  # per run after the first


def change(base: float | None, value: float | None, better: Better | None) -> dict[str, Any] | None:
    """How `value` differs from `base`: delta, ratio, and the direction in words."""
    if base is None or value is None:
        return None
    delta = value - base
    ratio = value / base if base else None
    rel = delta / base if base else (0.0 if delta == 0 else None)
    if rel is not None and abs(rel) < NOISE:
        verdict = "same"
    elif better is None:
        verdict = "higher" if delta > 0 else "lower"
    else:
        verdict = "better" if (delta > 0) == (better == "higher") else "worse"
    return {"delta": delta, "ratio": ratio, "relative": rel, "verdict": verdict}


def device_metrics(reports: list[dict[str, Any]]) -> list[Metric]:
    """CUDA-event times per phase, for the keys any run has."""
    keys = sorted({k for r in reports for k in (r.get("device_ms") or {})})
    return [Metric(f"device.{k}", f"  device {k}", "ms", "lower", _path("device_ms", k)) for k in keys]


def thin_notes(runs: list[dict[str, Any]]) -> list[str]:
    """One line per run with too few steps for its ratios to mean much."""
    most = max((r["steps"] for r in runs), default=0)
    return [
        f"{chr(65 + k)}: {r['name']} has {r['steps']} step{'s' if r['steps'] != 1 else ''} to compare"
        f" ({most} in the run with the most): too few to trust its changes; record it longer"
        " (--demo-seconds) or compare over --seconds"
        for k, r in enumerate(runs)
        if r["steps"] < THIN_STEPS
    ]


def compare(
    reports: list[dict[str, Any]], names: list[str], notes: list[str] | None = None
) -> dict[str, Any]:
    """The comparison as JSON-able data: runs (name, steps, verdict, flags, memory kind), rows,
    and notes (runs too thin to trust, and what the caller knows: a CPU without bf16)."""
    head = 3 + 2 * len(PHASES)  # steps/s, step times, then phase times and shares
    metrics = [*METRICS[:head], *device_metrics(reports), *METRICS[head:]]
    rows = []
    for m in metrics:
        values = [m.get(r) for r in reports]
        if all(not v for v in values):
            continue  # e.g. no MFU, no device times on CPU, no h2d copies
        rows.append(
            Row(
                m.key, m.label, m.unit, m.better, values, [change(values[0], v, m.better) for v in values[1:]]
            )
        )
    runs = [
        {
            "name": name,
            "target": r.get("target", ""),
            "device": r.get("device", ""),
            "device_name": r.get("device_name", ""),
            "steps": r.get("steps", 0),
            "span_s": r.get("covered_s", 0.0),
            "verdict": r.get("verdict", {}).get("kind", "unknown"),
            "severity": r.get("verdict", {}).get("severity", "ok"),
            "flags": list(r.get("flags", [])),
            "memory_kind": memory_peak(r)[1],
        }
        for name, r in zip(names, reports)
    ]
    for r in runs:
        r["thin"] = r["steps"] < THIN_STEPS
    return {
        "baseline": names[0] if names else "",
        "runs": runs,
        "rows": [row.__dict__ for row in rows],
        "notes": [*thin_notes(runs), *(notes or [])],
    }


def _value(v: float | None, unit: str) -> str:
    if v is None:
        return "—"
    if unit == "ms":
        return f"{fmt.ms(v)} ms"
    if unit == "/s":
        return fmt.rate(v)
    if unit == "bytes":
        return fmt.size(v)
    if unit in ("share", "ratio"):
        return fmt.pct(v)
    return fmt.number(v)


def _change_text(c: dict[str, Any] | None, unit: str, better: Better | None) -> str:
    if c is None:
        return ""
    if c["verdict"] == "same":
        return "≈ same"
    if unit in ("share", "ratio"):
        text = f"{c['delta'] * 100:+.1f} pt"
    else:
        text = f"{c['relative'] * 100:+.1f}%" if c["relative"] is not None else f"{c['delta']:+g}"
    ratio = c["ratio"]
    if better is not None and ratio and unit in ("ms", "/s"):
        fast = ratio if better == "higher" else 1 / ratio
        text += f" ({fast:.2f}x faster)" if fast > 1 else f" ({1 / fast:.2f}x slower)"
    elif unit == "bytes":
        text += " less" if c["delta"] < 0 else " more"
    return f"{text} {'✓' if c['verdict'] == 'better' else '✗' if c['verdict'] == 'worse' else ''}".rstrip()


def render_text(result: dict[str, Any]) -> str:
    """The comparison as a plain table: a column per run; after the first, each value with its
    change against the first."""
    runs = result["runs"]
    header = ["", *[f"{chr(65 + k)}: {r['name']}" for k, r in enumerate(runs)]]
    lines = [header]
    lines.append(["steps", *[f"{fmt.count(r['steps'])} in {r['span_s']:.1f} s" for r in runs]])
    for row in result["rows"]:
        cells = [row["label"], _value(row["values"][0], row["unit"])]
        thin = runs[0].get("thin", False)
        for v, c, run in zip(row["values"][1:], row["changes"], runs[1:]):
            ch = _change_text(c, row["unit"], row["better"])
            if ch and ch != "≈ same" and (thin or run.get("thin")):
                ch += " (thin: see note)"
            cells.append(f"{_value(v, row['unit'])}  {ch}".rstrip())
        lines.append(cells)
    memory = [r["memory_kind"] for r in runs]
    if any(memory):
        lines.append(["  memory is", *memory])
    lines.append(["verdict", *[f"{r['verdict']} ({r['severity']})" for r in runs]])
    lines.append(["flags", *[", ".join(r["flags"]) or "—" for r in runs]])
    lines.append(["device", *[(r["device_name"] or r["device"]) for r in runs]])
    widths = [max(len(line[k]) for line in lines) for k in range(len(header))]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines]
    out.insert(1, "  ".join("─" * w for w in widths))
    out += [f"note: {line}" for line in result.get("notes", [])]
    return "\n".join(out)
