"""`torchtop compare`: runs side by side, each against the first. Pure: reports in, rows out.

Each run is summed up by its report (diagnosis/report.py, over the run past warm-up); a row
holds one figure of every run and, for each run after the first, its change against the first
and whether that is better or worse (steps/s: higher is better; times and memory: lower).
Changes under NOISE are called "same": a run's own step times swing by that much.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from msgspec import UnsetType

from torchtop.contract.logcodes import PHASES
from torchtop.monitor.model import fmt

if TYPE_CHECKING:  # the report's types (diagnosis/report_types.py): the model layer imports no diagnosis
    from torchtop.monitor.diagnosis.report_types import RunReport

Better = Literal["higher", "lower"]
NOISE = 0.02  # relative changes smaller than this are "same"
THIN_STEPS = 20  # a run with fewer steps to compare: its ratios are said to rest on thin data


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    unit: Literal["ms", "/s", "bytes", "share", "ratio", "J", "W"]
    better: Better | None
    get: Callable[[RunReport], float | None]


def _known(value: float | UnsetType | None) -> float | None:
    return None if value is None or isinstance(value, UnsetType) else float(value)


def memory_peak(report: RunReport) -> tuple[float | None, str]:
    """The run's memory peak and what it is: the CUDA allocator's peak (largest device), else
    the training process's peak RSS (its whole memory: the only peak a CPU run has)."""
    peaks = [d.peak_allocated for d in report.memory.devices or [] if d.peak_allocated]
    if peaks:
        return float(max(peaks)), "CUDA peak allocated"
    host = report.host
    peak = host.proc_rss_peak or host.proc_rss
    return (float(peak), "peak RSS") if peak else (None, "")


def _energy(report: RunReport, figure: str) -> float | None:
    e = report.energy
    value = getattr(e, figure) if e is not None else None
    return float(value) if isinstance(value, (int, float)) else None


def mfu(report: RunReport) -> float | None:
    """Model FLOPs utilisation, where the report knows it (the run's FLOPs and the device's peak)."""
    return report.throughput.mfu


METRICS: tuple[Metric, ...] = (
    Metric("steps_per_s", "steps/s", "/s", "higher", lambda r: r.steps_per_s),
    Metric("step_time.median", "step time median", "ms", "lower", lambda r: _known(r.step_time_ms.median)),
    Metric("step_time.p90", "step time p90", "ms", "lower", lambda r: _known(r.step_time_ms.p90)),
    *(Metric(f"phase.{p}", f"  {p}", "ms", "lower", lambda r, p=p: r.phase_ms.get(p)) for p in PHASES),
    *(Metric(f"share.{p}", f"  {p} share", "share", None, lambda r, p=p: r.breakdown.get(p)) for p in PHASES),
    Metric("memory_peak", "memory peak", "bytes", "lower", lambda r: memory_peak(r)[0]),
    # where the report carries throughput (samples, tokens, FLOPs: the `throughput` section)
    Metric("samples_per_s", "samples/s", "/s", "higher", lambda r: r.throughput.samples_per_s),
    Metric("tokens_per_s", "tokens/s", "/s", "higher", lambda r: r.throughput.tokens_per_s),
    Metric("tflops", "achieved TFLOP/s", "/s", "higher", lambda r: r.throughput.achieved_tflops),
    Metric("mfu", "MFU", "ratio", "higher", mfu),
    # where a counter was readable (NVML's energy, RAPL): model/energy.py
    Metric("energy.per_step", "joules/step", "J", "lower", lambda r: _energy(r, "joules_per_step")),
    Metric("energy.per_sample", "joules/sample", "J", "lower", lambda r: _energy(r, "joules_per_sample")),
    Metric("energy.per_token", "joules/token", "J", "lower", lambda r: _energy(r, "joules_per_token")),
    Metric("energy.watts", "mean power", "W", None, lambda r: _energy(r, "watts")),
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


def device_metrics(reports: Sequence[RunReport]) -> list[Metric]:
    """CUDA-event times per phase, for the keys any run has."""
    keys = sorted({k for r in reports for k in r.device_ms})
    return [
        Metric(f"device.{k}", f"  device {k}", "ms", "lower", lambda r, k=k: r.device_ms.get(k)) for k in keys
    ]


def thin_notes(runs: list[dict[str, Any]], demo: bool = False) -> list[str]:
    """One line per run with too few steps for its ratios to mean much; `demo`: the runs are
    `--demo`'s own (their length is --demo-seconds), else the user's recordings."""
    most = max((r["steps"] for r in runs), default=0)
    longer = "record it longer (--demo-seconds)" if demo else "record the run longer"
    return [
        f"{chr(65 + k)}: {r['name']} has {r['steps']} {fmt.plural(r['steps'], 'step')} to compare"
        f" ({most} in the run with the most): too few to trust its changes; {longer}"
        " or compare over more of it (--seconds)"
        for k, r in enumerate(runs)
        if r["steps"] < THIN_STEPS
    ]


def _shown_zero(v: float | None, unit: str) -> bool:
    """Whether `v` reads as zero where it is shown ("0.0", "0.000 ms"): a ratio of two such
    figures is their rounding's, not the runs' (achieved TFLOP/s "0.0 -> 0.0, 8.59x slower")."""
    return v is not None and not any(c in "123456789" for c in _value(v, unit))


def compare(
    reports: Sequence[RunReport], names: list[str], notes: list[str] | None = None, demo: bool = False
) -> dict[str, Any]:
    """The comparison as JSON-able data: runs (name, steps, verdict, flags, memory kind), rows,
    and notes (runs too thin to trust, and what the caller knows: a CPU without bf16). `demo`:
    the runs are `--demo`'s (thin_notes)."""
    head = 3 + 2 * len(PHASES)  # steps/s, step times, then phase times and shares
    metrics = [*METRICS[:head], *device_metrics(reports), *METRICS[head:]]
    rows: list[Row] = []
    for m in metrics:
        values = [m.get(r) for r in reports]
        if all(not v for v in values):
            continue  # e.g. no MFU, no device times on CPU, no h2d copies
        changes = [
            None
            if _shown_zero(values[0], m.unit) and _shown_zero(v, m.unit)
            else change(values[0], v, m.better)
            for v in values[1:]
        ]
        rows.append(Row(m.key, m.label, m.unit, m.better, values, changes))
    runs: list[dict[str, Any]] = [
        {
            "name": name,
            "target": r.target,
            "device": r.device,
            "device_name": r.device_name,
            "steps": r.steps,
            "span_s": r.covered_s,
            "verdict": r.verdict.kind,
            "severity": r.verdict.severity,
            "flags": list(r.flags),
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
        "notes": [*thin_notes(runs, demo), *(notes or [])],
    }


def _value(v: float | None, unit: str) -> str:
    if v is None:
        return "—"
    if unit == "ms":
        return f"{fmt.ms(v)} ms"
    if unit == "/s":  # a small rate (a CPU's TFLOP/s, a slow run's steps/s) in 2 digits, not "0.0"
        return f"{v:.2g}" if 0 < v < 0.1 else fmt.rate(v)
    if unit == "bytes":
        return fmt.size(v)
    if unit in ("share", "ratio"):
        return fmt.pct(v)
    if unit in ("J", "W"):  # a token's joules are millijoules: significant digits, not decimals
        return f"{v:.3g} {unit}"
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
