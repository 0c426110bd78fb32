"""The verdict catalogue is complete: every verdict and flag has every part, every kind a rule can
emit has an entry, and the tables the UI and docs show are its views."""

from __future__ import annotations

import ast
from pathlib import Path

from torchtop.monitor.diagnosis.catalogue import CATALOGUE, FLAG_WORDS, VERDICT_WORDS, docs_table, entry
from torchtop.monitor.diagnosis.facts import THRESHOLDS as T
from torchtop.monitor.diagnosis.job_rules import JobFacts
from torchtop.monitor.diagnosis.selection import job_verdict
from torchtop.monitor.model.rank_stats import RankTimes

ROOT = Path(__file__).resolve().parents[1]
# decided outside the selection: from the step count before any rule runs (`unknown`); a rank's
# line inside its job from the job's straggler (`waiting`: diagnosis/in_job.py)
NOT_JUDGED = {"unknown", "waiting"}


def test_every_entry_has_every_part():
    for e in CATALOGUE:
        for part in ("headline", "meaning", "help", "when"):
            assert getattr(e, part).strip(), f"{e.role} {e.kind!r} lacks its {part}"
        assert e.role in ("verdict", "flag") and e.scope in ("rank", "job"), e
        if e.kind in NOT_JUDGED:
            continue
        assert callable(e.rule), f"{e.role} {e.kind!r} has no rule"
        assert e.upside is not None, f"{e.role} {e.kind!r} has no upside"
    keys = [(e.role, e.kind) for e in CATALOGUE]
    assert len(keys) == len(set(keys)), "one entry per verdict and per flag"
    assert sum(e.fallback for e in CATALOGUE) == 1


def _emitted_kinds() -> set[str]:
    """Every literal kind a rule in the diagnosis layer builds a Finding with."""
    kinds = set()
    for path in (ROOT / "monitor" / "diagnosis").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Finding" and node.args:
                first = node.args[0]
                choices = (first.body, first.orelse) if isinstance(first, ast.IfExp) else (first,)
                for kind in choices:  # a literal, or either literal of `"a" if x else "b"`
                    if isinstance(kind, ast.Constant) and isinstance(kind.value, str):
                        kinds.add(kind.value)
    return kinds


def test_every_emitted_kind_has_an_entry():
    kinds = _emitted_kinds()
    assert {"data-loading", "straggler", "memory-leak"} <= kinds  # the scan finds the rules
    missing = sorted(k for k in kinds if entry(k) is None and entry(k, "flag") is None)
    assert not missing, f"kinds without a catalogue entry (monitor/diagnosis/catalogue.py): {missing}"


def test_panel_words_are_views():
    assert VERDICT_WORDS["straggler"] == ("Straggler", "one rank holds every other rank back")
    assert FLAG_WORDS["sync"] == "waits on the GPU"
    assert set(VERDICT_WORDS) == {e.kind for e in CATALOGUE if e.role == "verdict"}


def test_docs_table_is_the_catalogue():
    text = (ROOT / "docs" / "verdicts.md").read_text()
    assert docs_table() in text, (
        "docs/verdicts.md's table differs from the catalogue: "
        "python -m torchtop.monitor.diagnosis.catalogue prints the table to paste"
    )


def _rank(step: float, comm: float, backward: float) -> RankTimes:
    phases = {"forward": 2.0, "backward": backward, "optimizer": 1.0, "comm": comm}
    return RankTimes(50, step, 50, phases, 0, {})


def test_job_verdicts_keep_their_verdict_under_hysteresis():
    """A straggler in force stays named while the others' wait is between 0.8x and 1x the
    lowest band, and is not named there when it was not in force (the rank verdicts' rule)."""
    step = 100.0
    wait = T.straggler_info * 0.9 * step  # under the info band, over 0.8 x it
    times = {
        0: _rank(step, 1.0, 10.0 + wait),
        1: _rank(step, 1.0 + wait, 10.0),
        2: _rank(step, 1.0 + wait, 10.0),
    }
    facts = JobFacts(times, "compute")
    assert job_verdict(facts, None) is None
    kept = job_verdict(facts, "straggler")
    assert kept is not None and kept.kind == "straggler" and kept.severity == "info"
    assert "rank 0" in kept.evidence[0]
