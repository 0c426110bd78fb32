"""The report's JSON stays what it is: `torchtop report` for a fixed run and a fixed job, built
now, equals the checked-in JSON of the commit before the report was typed (issue 27). A change
that means to change the report regenerates it (`python -m tests.test_report_compat`) and says
so in its commit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.rank_util import feed, rank_steps
from tests.test_why_rules import OTHER, SITE, spread, state_with
from tests.tui_util import steps
from torchtop.contract.wire import FlopInfo, SyncInfo
from torchtop.monitor.diagnosis.job_diagnosis import build_job_report
from torchtop.monitor.diagnosis.report import build_report
from torchtop.monitor.model.job_state import JobState

GOLDEN = Path(__file__).parent / "data" / "report_golden.json"


def run_report() -> dict[str, Any]:
    recs = steps(n=60, data=0.0, wall_ms=40.0)
    for s in recs:
        s.phases = {"data": 0, "h2d": 0, "forward": 5_000_000, "backward": 4_000_000, "optimizer": 1_000_000, "other": 30_000_000}  # fmt: skip
    samples = spread(recs, [(OTHER, SITE, "json:dumps", False)] * 3 + [(2, "/m/model.py:3 f", "", False)])
    flops = FlopInfo(state="done", source="counted", flops=int(4e11), by_dtype={"bfloat16": int(4e11)}, samples=32, t0=0, t1=0)  # fmt: skip
    state = state_with(recs, samples, sync=SyncInfo(state="idle", windows=2), flops=flops, util=40.0)
    return build_report(state, 10.0, "run")


def job_report() -> dict[str, Any]:
    job = JobState()
    per = {r: rank_steps(r, n=200, step_ms=100.0, comm=40.0 if r else 5.0, backward=45.0 if r == 0 else 10.0) for r in range(3)}  # fmt: skip
    feed(job, per, chunk=50)
    return build_job_report(job, 10.0, "job", now=0.0)


def reports() -> dict[str, Any]:
    # through JSON: what `torchtop report` prints
    return json.loads(json.dumps({"run": run_report(), "job": job_report()}))


def test_the_report_json_is_unchanged() -> None:
    got, want = reports(), json.loads(GOLDEN.read_text())
    for which in ("run", "job"):
        assert sorted(got[which]) == sorted(want[which]), f"{which}: the report's keys changed"
        for key in want[which]:
            assert got[which][key] == want[which][key], f"{which}.{key} changed"
    assert got["job"]["straggler"] is not None and got["run"]["verdict"]["kind"] == "host-code"


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps(reports(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")


def test_the_reports_host_section_holds_every_field_an_agent_sends() -> None:
    """The host section is the agent's HostSample, field for field: one the section lacks would
    fail every report of an agent that sends it."""
    from torchtop.contract.wire import HostSample
    from torchtop.monitor.diagnosis.report_types import HostSection

    assert set(HostSample.__struct_fields__) <= set(HostSection.__struct_fields__)
