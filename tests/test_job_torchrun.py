"""A real DDP job under torchrun (gloo, 4 ranks on CPU), one rank slow: the job report names it.

One run with a rank whose loader is slow, one with a rank whose backward computes more (the
case TraceML misses: DDP's all-reduce spreads that delay over every other rank's backward). The
report must list the 4 ranks and name the right rank and the right reason. On this loaded
2-core machine the slowdowns are large against the ~10-20 ms step, and the assertions are about
order and ratios.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.job_util import end_torchrun, wait_stepping
from torchtop.contract import discovery

pytestmark = [pytest.mark.slow, pytest.mark.phase_sampling]
RANKS = 4
SLOW_RANK = 1


@contextmanager
def ddp_job(tmp_path: Path, env: dict[str, str], *demo_args: str) -> Iterator[list[discovery.AgentInfo]]:
    """torchrun of the straggler demo on CPU; yields the 4 agents' discovery entries."""
    log = (tmp_path / "job.log").open("wb")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={RANKS}",
        "-m", "torchtop.demos.straggler", "--device", "cpu", "--seconds", "240", "--log-every", "0",
        "--slow-rank", str(SLOW_RANK), *demo_args,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        agents: list[discovery.AgentInfo] = []
        while len(agents) < RANKS and time.monotonic() < deadline and proc.poll() is None:
            agents = [a for a in discovery.list_agents() if a.world_size == RANKS]
            time.sleep(0.2)
        if len(agents) < RANKS:
            log.flush()
            raise AssertionError(
                f"{len(agents)} agents started: {(tmp_path / 'job.log').read_text()[-3000:]}"
            )
        yield agents
    finally:
        end_torchrun(proc)
        log.close()


def job_report(env: dict[str, str], seconds: float = 8.0) -> dict:
    """`torchtop report` with no target on a machine running one job: the job report."""
    time.sleep(4.0)  # past the first steps (start-up, the process group's first all-reduces)
    wait_stepping(RANKS)  # ... however long a loaded machine took to start them
    proc = subprocess.run(
        [sys.executable, "-m", "torchtop.monitor.commands.cli", "report", "--seconds", str(seconds)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def check_ranks(report: dict) -> dict[int, dict]:
    ranks = {e["rank"]: e for e in report["ranks"]}
    assert sorted(ranks) == list(range(RANKS))
    assert report["world_size"] == RANKS and report["job_id"]
    assert all(e["status"] == "connected" and e["steps"] > 0 for e in ranks.values())
    assert report["collective"]["source"] == "host"  # gloo: the training thread waits
    return ranks


def test_slow_loader_is_named(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    with ddp_job(tmp_path, subprocess_env, "--slow", "data", "--delay-ms", "80"):
        report = job_report(subprocess_env)
    ranks = check_ranks(report)
    s = report["straggler"]
    assert s is not None, report["collective"]
    assert s["rank"] == SLOW_RANK and s["phase"] == "data", s
    assert report["verdict"]["kind"] == "straggler"
    assert f"rank {SLOW_RANK}: data wait" in report["verdict"]["evidence"][0]
    slow = ranks[SLOW_RANK]
    others = [e for r, e in ranks.items() if r != SLOW_RANK]
    # the slow rank waits for data, the others wait for it in DDP's all-reduce
    assert slow["phase_ms"]["data"] > 5 * max(e["phase_ms"]["data"] for e in others)
    assert min(e["comm_ms"] for e in others) > slow["comm_ms"]
    assert s["others_wait_ms"] > 0.5 * (slow["phase_ms"]["data"] - max(e["phase_ms"]["data"] for e in others))
    assert report["scaling"]["lost_to_waiting"] > 0.2


def test_slow_backward_is_named(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    with ddp_job(tmp_path, subprocess_env, "--slow", "backward", "--extra", "40"):
        report = job_report(subprocess_env)
    ranks = check_ranks(report)
    s = report["straggler"]
    assert s is not None, report["collective"]
    assert s["rank"] == SLOW_RANK and s["phase"] == "backward", s
    slow = ranks[SLOW_RANK]
    others = [e for r, e in ranks.items() if r != SLOW_RANK]
    # host backward time (compute + wait) looks alike on every rank, as TraceML sees it; the
    # split tells them apart: the slow rank computes, the others wait
    compute = {r: e["phase_ms"]["backward"] for r, e in ranks.items()}
    assert compute[SLOW_RANK] > 2 * max(compute[r] for r in ranks if r != SLOW_RANK)
    assert min(e["comm_ms"] for e in others) > slow["comm_ms"]
    whole = {r: e["phase_ms"]["backward"] + e["phase_ms"]["comm"] for r, e in ranks.items()}
    assert max(whole.values()) < 2 * min(whole.values())  # what a compute-only view would see


async def test_captures_the_same_steps_on_every_rank(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    """`p` in the job view: a profile of the same 3 steps on each of the 4 ranks, each trace
    named by its rank, and the summary says which rank's trace shows the wait."""
    from tests.tui_util import wait_for
    from torchtop.monitor.link.job_targets import JobPlan, local_job
    from torchtop.monitor.link.targets import from_discovery
    from torchtop.monitor.tui.job_app import JobApp

    env = {**subprocess_env, "TORCHTOP_DIR": str(tmp_path / "captures")}
    with ddp_job(tmp_path, env, "--slow", "data", "--delay-ms", "80"):
        group = local_job(None)
        assert group is not None and len(group.agents) == RANKS
        app = JobApp(JobPlan([from_discovery(a) for a in group.agents], group.job_id))
        async with app.run_test(size=(120, 40)) as pilot:
            assert await wait_for(
                pilot, lambda: sum(bool(m.state.steps) for m in app.job.live()) == RANKS, 60
            )
            await pilot.pause(3.0)
            app.capture_steps = 3
            await pilot.press("p")
            assert await wait_for(pilot, app.job_captures.finished, 120), app.job_captures.state()
            r = app.job_captures.round
            assert r is not None
            done = {app.job.members[k].rank: app.job_captures.captures(k)[0] for k in r.keys}
            assert sorted(done) == list(range(RANKS))
            assert all(c.state == "done" and c.start_step == r.at_step for c in done.values()), done
            assert all(f"profile-rank{rank}-" in Path(c.path).name for rank, c in done.items())
            assert all(Path(c.path).is_file() for c in done.values())
            await pilot.pause(1.0)  # the captured steps' records reach the monitor
            from torchtop.monitor.model.job_captures import round_summary

            first = round_summary(app.job, app.job_captures)[0]
            assert f"rank {SLOW_RANK}'s shows the most time of its own" in first, first
            waits = int(first.split("rank ")[1].split("'")[0])
            assert waits != SLOW_RANK, first
