"""The job side of the `torchtop` command: which targets mean a job, and `report` over one.

`attach`, `report` and `ls` take a job where they took one agent: several targets, a hosts file,
a SLURM nodelist, or nothing on a machine (or an ssh host) that runs one job of several ranks.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchtop.contract.discovery import AgentInfo
    from torchtop.monitor.diagnosis.events import EventLog

from torchtop.monitor.link.job_link import JobLink, apply_events
from torchtop.monitor.link.job_targets import describe_job, group_by_job
from torchtop.monitor.model.job_state import JobState

CONNECT_S = 10.0  # how long `report` waits for every rank's hello before it starts the clock


def add_arguments(p: argparse.ArgumentParser) -> None:
    """--hosts, --slurm and --job for commands that take a job."""
    from torchtop.monitor.commands.args import positive

    p.add_argument("--hosts", metavar="FILE", help="a job on several nodes: one ssh://[user@]host a line")
    p.add_argument(
        "--slurm",
        metavar="NODELIST",
        nargs="?",
        const="",
        default=None,
        help="a job on SLURM nodes: their nodelist (default: $SLURM_JOB_NODELIST), reached over ssh",
    )
    p.add_argument("--job", metavar="ID", help="the job (its id or a prefix) where several run")
    p.add_argument(
        "--store",
        metavar="HOST:PORT",
        help="find the job's nodes in its rendezvous store (torchrun's master address and port): "
        "each node's relay, reached over ssh",
    )
    p.add_argument(
        "--baseline-ms",
        type=positive,
        default=None,
        help="the step time of the same job on 1 rank, for the scaling efficiency",
    )


def job_targets(args: argparse.Namespace) -> list[str] | None:
    """The targets when the command is about a job (None: about one agent, as before)."""
    from torchtop.monitor.link import hosts, ssh

    targets = list(getattr(args, "targets", None) or [])
    if getattr(args, "store", None):
        from torchtop.monitor.link.relay_targets import relays_from_store
        from torchtop.monitor.link.store import parse_store
        from torchtop.monitor.link.targets import TargetError

        try:
            where = parse_store(args.store)
        except ValueError as exc:
            raise TargetError(str(exc)) from None
        args.store_notes = []  # what the store's registrations had to say: the report's notes
        args.job, found = relays_from_store(where, getattr(args, "job", None), args.store_notes)
        return targets + found
    if getattr(args, "hosts", None):
        targets += hosts.read_hosts_file(args.hosts)
    if getattr(args, "slurm", None) is not None:
        targets += hosts.slurm_targets(args.slurm or None)
    if len(targets) > 1 or getattr(args, "job", None):
        return targets
    if not targets:
        from torchtop.monitor.link.job_targets import choose_job
        from torchtop.monitor.link.targets import local_agents

        groups = group_by_job(local_agents())
        if not any(len(g.agents) > 1 for g in groups):
            return None  # one agent, or several on their own: the chooser, as before
        group = choose_job(groups, None, "this machine")  # several jobs: says which, and --job
        return _other_nodes(group.job_id)
    if ssh.is_ssh(targets[0]) and ssh.parse(targets[0]).select is None:
        return None if _single_agent_host(targets[0], args) else targets
    return None


def _other_nodes(job_id: str) -> list[str]:
    """On a node of a job of several nodes: every node's ssh target from the relays registered in
    the job's store; [] (this node's ranks only) when it has no store or lists this node alone."""
    import socket

    from torchtop.monitor.link.relay_targets import relays_from_store
    from torchtop.monitor.link.store import store_of_job
    from torchtop.monitor.link.targets import TargetError

    where = store_of_job(job_id)
    if where is None:
        return []
    try:
        _, found = relays_from_store(where, job_id)
    except TargetError:
        return []  # no store to read, or no relay in it: this node's ranks, as before
    here = {f"ssh://{os.environ.get('TORCHTOP_NODE') or socket.gethostname()}"}
    return found if set(found) - here else []


def _single_agent_host(target: str, args: argparse.Namespace) -> bool:
    """An ssh host with one agent (or none, or unreachable): the one-agent path says why."""
    from torchtop.monitor.link import ssh

    try:
        agents = ssh.remote_agents(ssh.parse(target), getattr(args, "ssh_option", ()))
    except ssh.SshError:
        return True
    groups = group_by_job(agents)
    return len(groups) != 1 or len(groups[0].agents) <= 1


def collect_job(
    link: JobLink,
    job: JobState,
    seconds: float,
    connect_s: float = CONNECT_S,
    events: EventLog | None = None,
) -> JobState:
    """Connect every member (up to `connect_s`), then feed `seconds` of batches into `job`.
    `events`: the job judged once a second meanwhile, with its hysteresis, as the live view does
    (the report's events)."""
    from torchtop.monitor.diagnosis.events import TICK_S
    from torchtop.monitor.diagnosis.job_diagnosis import diagnose_job

    deadline = time.monotonic() + connect_s
    started: float | None = None
    due = 0.0
    while True:
        now = time.monotonic()
        relays = link.relayed.relays if link.relayed is not None else {}
        heard = all(_answered(job, key) for key in link.members) and all(r in job.relays for r in relays)
        if started is None and (heard or now >= deadline):
            started = now
        if started is not None and now - started >= seconds:
            return job
        apply_events(job, link.poll(0.2), time.monotonic())
        if events is not None and started is not None and job.ranked() and time.monotonic() >= due:
            due = time.monotonic() + TICK_S
            judged, _ = diagnose_job(job, events.last)
            events.observe(judged, max(m.state.agent_time for m in job.members.values()))


def _answered(job: JobState, key: str) -> bool:
    m = job.members.get(key)
    return m is not None and (m.hello is not None or m.refused)


def ls_lines(agents: list[AgentInfo]) -> list[str]:
    """`torchtop ls`: each job on a line with its ranks under it; agents on their own as before."""
    from torchtop.monitor.link.targets import describe, listens

    out: list[str] = []
    for g in group_by_job(agents):
        if not g.job_id or (len(g.agents) == 1 and (g.agents[0].world_size or 1) <= 1):
            out += [describe(a) for a in g.agents]
            continue
        out.append(describe_job(g))
        out += [f"  rank {a.rank or 0:>3}  pid {a.pid}  {listens(a)}  {a.host or ''}" for a in g.agents]
    return out
