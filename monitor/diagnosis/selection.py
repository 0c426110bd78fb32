"""How the catalogue's rules become a diagnosis: one selection, one hysteresis, for a rank's
verdict and a job's alike.

Each verdict rule runs with its thresholds x1, or x`hysteresis` (0.8) for the verdict in force,
so a verdict does not flap on noise; a rule kept by hysteresis keeps its severity band, at its
lowest. Among a rank's findings the most severe wins, then the verdict in force, then the largest
share; none: the fallback (`compute`). A job's rules name a cause before a symptom, so the first
found in catalogue order wins (a straggler before the collective wait it causes), except that the
job verdict in force is kept while it holds at x0.8 unless a cause before it holds at x1.25;
none: the aggregate's verdict. Flags are independent: every one that fires. Then each finding's upside.
"""

from __future__ import annotations

from dataclasses import replace

from torchtop.monitor.diagnosis.catalogue import CATALOGUE, entries, upside_rule
from torchtop.monitor.diagnosis.facts import SEVERITY_RANK, THRESHOLDS, Diagnosis, Facts, Finding
from torchtop.monitor.diagnosis.job_rules import JobFacts
from torchtop.monitor.diagnosis.why import refine


def _scale(kind: str, previous: str | None) -> float:
    return THRESHOLDS.hysteresis if kind == previous else 1.0


def primary(f: Facts, previous: str | None = None) -> Finding:
    """A rank's verdict: the worst bottleneck past its threshold, else the fallback (compute)."""
    found: list[Finding] = []
    fallback = None
    for e in entries("verdict", "rank"):
        if e.rule is None:
            continue
        if e.fallback:
            fallback = e
            continue
        result = e.rule(f, _scale(e.kind, previous))  # type: ignore[arg-type]
        if result is not None:
            found.append(result)
    if not found:
        assert fallback is not None and fallback.rule is not None
        return refine(fallback.rule(f, 1.0), f)  # type: ignore[arg-type]
    return refine(max(found, key=lambda x: (SEVERITY_RANK[x.severity], x.kind == previous, x.share)), f)


def flags_of(f: Facts) -> tuple[Finding, ...]:
    out: list[Finding] = []
    for e in entries("flag", "rank"):
        assert e.rule is not None
        result = e.rule(f, 1.0)  # type: ignore[arg-type]
        if result is not None:
            out.append(result)
    return tuple(out)


def job_verdict(j: JobFacts, previous: str | None = None) -> Finding | None:
    """The job's own verdict (a straggler, the collective wait...), or None: the aggregate's
    stands. The job verdict in force, while its rule still holds at x0.8, is displaced only by
    a clearly stronger one: a cause named before it in the catalogue that holds at x1/0.8."""
    rules = [e for e in entries("verdict", "job") if e.rule is not None]
    kept = next((e.rule(j, THRESHOLDS.hysteresis) for e in rules if e.kind == previous), None)  # type: ignore[arg-type]
    for e in rules:
        if e.kind == previous:
            if kept is not None:
                return kept
            continue
        result = e.rule(j, 1.0 / THRESHOLDS.hysteresis if kept is not None else 1.0)  # type: ignore[arg-type]
        if result is not None:
            return result
    return None


def with_upside(finding: Finding, f: Facts) -> Finding:
    rule = upside_rule(finding.kind)
    if rule is None or finding.upside is not None:
        return finding
    try:
        up = rule(f)
    except (ArithmeticError, ValueError):
        up = None
    return finding if up is None else replace(finding, upside=up)


def with_upsides(d: Diagnosis, f: Facts) -> Diagnosis:
    """The diagnosis with each verdict's and flag's upside."""
    return replace(d, verdict=with_upside(d.verdict, f), flags=tuple(with_upside(x, f) for x in d.flags))


__all__ = ["CATALOGUE", "flags_of", "job_verdict", "primary", "with_upside", "with_upsides"]
