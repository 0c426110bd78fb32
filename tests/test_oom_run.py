"""Issue 38's "done when" for time to out-of-memory, for real on CPU: a torch loop that keeps
1 MiB a step, with TORCHTOP_MEMORY_LIMIT set some hundred MiB above its RSS, is forecast ~25 s
in to reach the limit within 20% of when its RSS does (the script says when, and stops there:
the machine's memory is never exhausted)."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

from tests.job_util import Job, report, show

pytestmark = pytest.mark.slow  # a minute of a real leaking loop

HEADROOM_MIB = 800  # ~55 s of the loop's 1 MiB a step at ~15 steps a second

SCRIPT = """
import os, sys, time
import torch
import torchtop.agent

def rss():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

limit = rss() + {headroom} * 2**20
os.environ["TORCHTOP_MEMORY_LIMIT"] = str(limit)  # the user's limit, read by the agent at start
torchtop.agent.start()
model = torch.nn.Linear(64, 64)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(32, 64)
kept = []
for step in range(100000):
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
    kept.append(b"\\x01" * (1 << 20))  # a fixed-size leak, every page touched
    if step % 10 == 0:
        print(f"step {{step}}", flush=True)
    if rss() >= limit:
        print(f"crossed {{time.time():.3f}} at step {{step}}", flush=True)
        break
    time.sleep(0.06)
time.sleep(60)  # stays up (and stops growing) until the test ends it
"""


def test_forecast_within_a_fifth_of_when_the_limit_is_reached(tmp_path: Path) -> None:
    script = tmp_path / "leak.py"
    script.write_text(SCRIPT.format(headroom=HEADROOM_MIB))
    with Job([sys.executable, str(script)]) as job:
        started = time.monotonic()
        job.wait_for_step(60, timeout=120)
        time.sleep(max(0.0, 26.0 - (time.monotonic() - started)))  # 20 s of lows past step 50
        for _ in range(8):  # on a loaded machine the loop is slower: 20 s of lows past step 50 come later
            r = report(job.pid, 3.0, "--history")
            said_at = time.time()
            printed = [int(m.group(1)) for m in map(re.compile(r"^step (\d+)").search, list(job.lines)) if m]
            if r["oom_forecast"] is not None:
                break
            time.sleep(2.0)
        show("a leak of 1 MiB a step", r)
        o = r["oom_forecast"]
        assert o is not None, r["flag_details"]
        crossed = float(job.wait_for(r"^crossed (\d+\.\d+)", timeout=240).group(1))
    truth = crossed - said_at
    steps = [int(m.group(1)) for m in map(re.compile(r"^crossed .* at step (\d+)").search, job.lines) if m]
    assert steps and printed, job.lines[-5:]
    left = steps[0] - printed[-1]  # steps from the report to the limit (the last printed, 10 apart)
    print(
        f"forecast {o['steps']} steps, {o['seconds']:.1f} s ({o['confidence']}); reached {left} steps, {truth:.1f} s after it"
    )
    assert truth > 10, f"the limit was reached too soon after the forecast to judge it: {truth:.1f} s"
    # in steps within a fifth; in seconds the pace after the report is the machine's (CI's other
    # worker can slow the loop by a third), so a wider bound there
    assert o["steps"] == pytest.approx(left, rel=0.2, abs=10), (o, left)
    assert o["seconds"] == pytest.approx(truth, rel=0.4), (o, truth)
    assert o["limit_from"] == "TORCHTOP_MEMORY_LIMIT" and o["rate_bytes_per_step"] == pytest.approx(
        2**20, rel=0.2
    )
