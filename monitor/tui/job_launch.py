"""Opening the job view (job_app.py): on the job some targets name, on a plan of its ranks, or on
discovery entries when they are the ranks of one job (`torchtop run`, `torchtop demo`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from torchtop.monitor.link.job_targets import JobPlan
from torchtop.monitor.tui import bindings
from torchtop.monitor.tui.job_app import JobApp

if TYPE_CHECKING:
    from torchtop.contract.discovery import AgentInfo


def run_job_tui(
    targets: Sequence[str],
    job: str | None = None,
    ssh_options: Sequence[str] = (),
    baseline_ms: float | None = None,
    log_path: Path | None = None,
    notes: Sequence[str] = (),
) -> int:
    """Open the job view on the job these targets name (nothing: this machine's); `notes`: what
    finding them had to say."""
    from torchtop.monitor.link.job_targets import open_job

    with open_job(targets, job, ssh_options, notes) as plan:
        return run_plan(plan, baseline_ms, log_path)


def run_plan(
    plan: JobPlan,
    baseline_ms: float | None = None,
    log_path: Path | None = None,
    mode: bindings.LeaveMode = "attach",
) -> int:
    app = JobApp(plan, baseline_ms=baseline_ms, log_path=log_path, leaving=bindings.Leaving(mode))
    app.run()
    return app.return_code or 0


def job_plan_of(agents: list[AgentInfo]) -> JobPlan | None:
    """The plan of one job when these discovery entries are its ranks (two or more); else None."""
    from torchtop.monitor.link.job_targets import group_by_job
    from torchtop.monitor.link.targets import from_discovery

    groups = group_by_job(agents)
    if len(groups) != 1 or len(groups[0].agents) < 2:
        return None
    return JobPlan([from_discovery(a) for a in groups[0].agents], groups[0].job_id)


def run_agents_tui(
    agents: list[AgentInfo], log_path: Path | None = None, mode: bindings.LeaveMode = "attach"
) -> int | None:
    """The job view when these discovery entries are the ranks of one job (`torchtop run`,
    `torchtop demo`); None otherwise (the caller opens the one-agent view)."""
    plan = job_plan_of(agents)
    if plan is None:
        return None
    return run_plan(plan, log_path=log_path, mode=mode)
