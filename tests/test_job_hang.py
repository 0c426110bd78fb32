"""Issue 38 item 1, end to end on CPU: a hang named by the rank that never arrived.

A 3-rank torchrun job (gloo) where rank 1 sleeps inside its loop, outside any collective
(tests/loops/hang_job.py): within 15 s of the stop `torchtop report` says `stalled`, names rank 1
with its file:line and the call it is blocked in, and ranks 0 and 2 as waiting in all_reduce by
its sequence number (torch's flight recorder, read by the agent while stalled); no
straggler is named. One process blocked in `os.read` on a pipe nobody writes
(tests/loops/blocked_read.py) is named with its stack. After each block ends, "resumed" is said.
The deadline is read off the report's own words ("no step end for X s": when the monitor said it,
counted from the stop on the agent's clock); the reports themselves run as long as the machine
lets them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from torchtop.contract import discovery

pytestmark = pytest.mark.slow
LOOPS = Path(__file__).parent / "loops"
DEADLINE_S = 15.0  # the issue's: the stall said within 15 s of the stop
HANG_S = 22.0  # the deadline and a few reports past it; the rank resumes then
FIRST_REPORT_S = 7.0  # the first report from the stop: past the monitor's stall limit (5 s)


@contextmanager
def started(tmp_path: Path, env: dict[str, str], argv: list[str], agents: int) -> Iterator[Path]:
    """The job running with its agents listed; yields the file it writes when it stops."""
    mark = tmp_path / "stopped"
    log = (tmp_path / "job.log").open("wb")
    cmd = [*argv, "--mark", str(mark)]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if len(discovery.list_agents()) >= agents:
                break
            time.sleep(0.2)
        else:
            log.flush()
            raise AssertionError((tmp_path / "job.log").read_text()[-3000:])
        yield mark
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


def report(env: dict[str, str], seconds: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "torchtop.monitor.commands.cli", "report", "--seconds", str(seconds)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=seconds + 120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    print(json.dumps(out["verdict"]["evidence"], indent=1))
    return out


def until_stalled(env: dict[str, str], mark: Path) -> dict[str, Any]:
    """Reports from the stop on, until one says `stalled` (or the stop is long past). The first
    runs past the stall limit (5 s) by itself: a report says the stall's age at its end, and one
    that ended just short of the limit left the saying to a second report, whose start-up a
    loaded machine can stretch past the deadline."""
    deadline = time.monotonic() + 120
    while not mark.exists():
        assert time.monotonic() < deadline, "the job never stopped"
        time.sleep(0.1)
    stop = time.monotonic()
    seconds = FIRST_REPORT_S
    while True:
        r = report(env, seconds)
        seconds = 3
        if r["verdict"]["kind"] == "stalled" or time.monotonic() - stop > HANG_S - 5:
            return r


def said_within_deadline(verdict: dict[str, Any]) -> None:
    m = re.match(r"no step end (?:on any rank )?for (\d+) s", verdict["evidence"][0])
    assert m is not None, verdict
    assert int(m.group(1)) <= DEADLINE_S, verdict["evidence"][0]


def test_a_hung_rank_is_named_and_the_others_wait_in_the_collective(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
        str(LOOPS / "hang_job.py"), "--hang-rank", "1", "--after", "6", "--hang", str(HANG_S),
    ]  # fmt: skip
    with started(tmp_path, subprocess_env, argv, 3) as mark:
        r = until_stalled(subprocess_env, mark)
        v = r["verdict"]
        assert v["kind"] == "stalled", v
        said_within_deadline(v)
        assert r["straggler"] is None  # the waiting ranks are never blamed
        # the rank that holds the job first, then the ones waiting for it (a window's note may come between)
        ev = [e for e in v["evidence"] if e.startswith("rank")]
        assert len(ev) == 2, v["evidence"]
        assert re.match(
            r"rank 1 is in `time\.sleep` at hang_job\.py:\d+ stop_here, outside any collective", ev[0]
        ), ev
        # the collective by its sequence number, from torch's flight recorder (on at agent start)
        assert re.match(r"ranks 0, 2 wait in all_reduce #\d+ since \d+ s", ev[1]), ev
        assert v["advice"][0].startswith("rank 1 holds the job")
        ranks = {e["rank"]: e["verdict"] for e in r["ranks"]}
        assert any(re.search(r"waits in all_reduce #\d+ at hang_job\.py", e) for e in ranks[0]["evidence"]), (
            ranks[0]
        )
        # a report that runs while the rank resumes: the stall is said as resumed, its rank named
        left = HANG_S - (time.time() - float(mark.read_text()))
        after = report(subprocess_env, max(1.0, left) + 4)
    lines = [e for e in after["verdict"]["evidence"] if e.startswith("resumed ")]
    assert after["verdict"]["kind"] != "stalled" and lines, after["verdict"]
    assert "(rank 1 was in `time.sleep` at hang_job.py:" in lines[0], lines
    # the job report's events: judged once a second while it collected, the stall's end among them
    assert "resumed" in [e["kind"] for e in after["events"]], after["events"]


def test_a_process_blocked_in_a_read_is_named_with_its_stack(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    argv = [sys.executable, str(LOOPS / "blocked_read.py"), "--after", "6", "--block", str(HANG_S)]
    with started(tmp_path, subprocess_env, argv, 1) as mark:
        r = until_stalled(subprocess_env, mark)
        v = r["verdict"]
        assert v["kind"] == "stalled", v
        said_within_deadline(v)
        where = [e for e in v["evidence"] if e.startswith("the training thread is in")]
        assert where and re.match(
            r"the training thread is in `os\.read` at blocked_read\.py:\d+ read_one", where[0]
        )
        assert "collective" not in where[0]  # one process: no collectives to be outside of
        left = HANG_S - (time.time() - float(mark.read_text()))
        after = report(subprocess_env, max(1.0, left) + 4)
    lines = [e for e in after["verdict"]["evidence"] if e.startswith("resumed ")]
    assert after["verdict"]["kind"] != "stalled" and lines, after["verdict"]
    assert "(the training thread was in `os.read` at blocked_read.py:" in lines[0], lines
