"""The relay benchmarks (tests/benchmarks/bench_relays.py) at a reduced size, so that they cannot
rot: a real relay of 8 ranks, and the real job view over 16 nodes' relays (128 ranks) with one
rank slowed. Their goals that hold on any machine: no crash, >= 95% of what was due received
(the job view: none of the relays' sequence numbers skipped past 5%), every rank current, the slowed rank named (its CPU shares and the time to the name are measured
at full size: docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
BENCH = Path(__file__).parent / "benchmarks" / "bench_relays.py"


def _run(*args: str) -> dict:
    proc = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    last = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert last, out[-3000:]
    return json.loads(last[-1][len("RESULT ") :])


def test_the_job_view_over_16_relays() -> None:
    # the rank slows a third into the run (13 s in): 16 s to be named, on a loaded machine too
    got = _run(
        "monitor", "--nodes", "16", "--per-node", "8", "--seconds", "24", "--warm", "5", "--slow-rank", "77"
    )
    assert got["received"] >= 0.95, got
    assert got["current"] == got["ranks"] == 128, got
    assert got["named_after_s"] is not None, got


def test_a_relay_of_8_ranks() -> None:
    got = _run("relay", "--ranks", "8", "--seconds", "10", "--warm", "5")
    assert got["received"] >= 0.95, got
    assert got["current"] == got["ranks"] == 8, got
