"""Issue 25: scripts nobody here wrote, first try, under TORCHTOP=1 and judged by `torchtop
report` as a user would see them: a loop that updates its weights by hand (no optimizer.step()),
an inference-only loop, 3 s steps, a metrics helper that holds the step, a generator-fed loop.
The scripts are in tests/loops/."""

from __future__ import annotations

import re
import time

import pytest

from tests.job_util import report, show
from tests.test_user_loops import _loop, _run
from torchtop.monitor.diagnosis.warmup import BACKWARD_NOTE

pytestmark = [pytest.mark.slow, pytest.mark.phase_sampling]


def test_a_loop_that_steps_by_hand_shows_its_steps() -> None:
    """word_language_model's `p.data.add_(p.grad, alpha=-lr)`: it read "0 steps seen" forever."""
    with _loop("manual_sgd") as job:
        job.wait_for("^step 40$", timeout=400)
        r = report(job.pid, 5.0, "--history")
    show("manual_sgd", r)
    assert r["steps"] >= 10 and r["micro_batches"] == 1.0, r["steps"]
    assert r["verdict"]["kind"] != "unknown" and BACKWARD_NOTE in r["verdict"]["evidence"], r["verdict"]
    assert r["breakdown"]["backward"] > 0.1 and r["breakdown"]["optimizer"] == 0, r["breakdown"]


def test_an_inference_loop_is_judged_on_its_forward_latency() -> None:
    with _loop("eval_only", "--loader") as job:
        job.wait_for("^forwards 200$", timeout=400)
        r = report(job.pid, 5.0, "--history")
    show("eval_only", r)
    v = r["verdict"]
    assert v["kind"] != "unknown" and r["eval_steps"] >= 20, v
    line = next(e for e in v["evidence"] if e.startswith("inference only"))
    p50, p99 = (float(x) for x in re.findall(r"p(?:50|99) ([\d.]+) ms", line))
    assert 0 < p50 <= p99, line
    assert r["eval_latency_ms"]["p50"] > 0 and r["eval_latency_ms"]["p99"] >= r["eval_latency_ms"]["p50"], r


def test_three_second_steps_get_a_verdict_within_30_s_with_its_confidence() -> None:
    """Warm-up counted in steps (10, then 5 judged) kept 3-13 s steps "Warming up" for minutes."""
    with _loop("slow_steps", "--step-s", "3") as job:
        job.wait_for("^step 1$", timeout=400)
        first = time.monotonic()
        job.wait_for("^step 8$", timeout=120)  # 24 s of steps
        r = report(job.pid, 1.0, "--history")
        asked = time.monotonic() - first
    show("slow_steps", r)
    v = r["verdict"]
    assert v["kind"] != "unknown", v
    assert any(
        re.match(r"confidence (low|moderate): judged on \d+ steps? of 3\.\d s", e) for e in v["evidence"]
    ), v
    assert asked < 60, asked  # the loop's own 24 s, and the report's start on a loaded machine


def test_a_metrics_helper_is_named_by_its_function_and_call_site() -> None:
    """It read `host-code` at `train.py:42 main`: the helper's lines and comprehensions, each a
    few percent, lost to the one line of the loop."""
    r = _run("metrics_helper")
    v = r["verdict"]
    assert v["kind"] == "host-code", v
    named = r"^\d+% in metrics_helper\.py:\d+ compute_metrics, called at metrics_helper\.py:\d+ main "
    assert re.match(named, v["evidence"][1]), v  # the first place named
    assert "compute_metrics" in v["advice"][0], v
    top = r["hot_functions"]["other"][0]
    assert top["site"].endswith(" compute_metrics") and top["share"] >= 0.4, top
