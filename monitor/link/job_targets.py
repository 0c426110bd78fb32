"""Which agents make up the job a command is about, and the way to each of them.

Agents are grouped by the job id each one publishes (agent/identity.py): the ranks of one job
share it, two jobs never do. `open_job` turns what the user typed (nothing: this machine; pids
or HOST:PORT; ssh:// targets, a hosts file or a SLURM nodelist) into one job's endpoints. For
ssh targets every host is listed in parallel and every agent of the job gets a tunnel through
ssh.py; a host whose ssh fails is named in one line (`JobPlan.notes`) and the others are shown.
No textual, no torch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

from torchtop.contract.discovery import AgentInfo, entry
from torchtop.contract.relay import RelayInfo
from torchtop.monitor.link.targets import Endpoint, TargetError, from_discovery, local_agents, parse

PARALLEL = 16  # hosts listed, tunnels opened, at once


@dataclass
class JobGroup:
    """Agents of one job (or one agent on its own: job_id "")."""

    job_id: str
    agents: list[AgentInfo]

    @property
    def ranks(self) -> list[int]:
        return sorted(_rank(a) for a in self.agents)


def _rank(a: AgentInfo) -> int:
    return a.rank if a.rank is not None else 0


@dataclass
class JobPlan:
    endpoints: list[Endpoint]
    job_id: str = ""
    notes: list[str] = field(default_factory=list)  # hosts that failed, other jobs left out
    relays: list[Endpoint] = field(default_factory=list)  # nodes read through their relay (one each)


def group_by_job(agents: list[AgentInfo]) -> list[JobGroup]:
    """Agents grouped by job id, in order of first appearance; ranks within a job in order.
    Agents without a job id (a single process, or an older torchtop) are groups of their own."""
    groups: dict[str, JobGroup] = {}
    singles: list[JobGroup] = []
    for a in agents:
        jid = a.job_id or ""
        if not jid:
            singles.append(JobGroup("", [a]))
            continue
        groups.setdefault(jid, JobGroup(jid, [])).agents.append(a)
    for g in groups.values():
        g.agents.sort(key=lambda a: (_rank(a), a.host or "", a.pid or 0))
    return [*groups.values(), *singles]


def ranks_text(ranks: list[int]) -> str:
    """0-3,5 for [0, 1, 2, 3, 5]."""
    out, start, prev = [], None, None
    for r in sorted(set(ranks)):
        if start is None:
            start = prev = r
        elif r == prev + 1:  # type: ignore[operator]
            prev = r
        else:
            out.append(f"{start}-{prev}" if prev != start else str(start))
            start = prev = r
    if start is not None:
        out.append(f"{start}-{prev}" if prev != start else str(start))
    return ",".join(out)


def short_job_id(job_id: str, keep: int = 8) -> str:
    """A torchelastic uuid cut short, the rendezvous address kept: 97ac7439…@node1:29500."""
    head, at, tail = job_id.partition("@")
    return (head[:keep] + "…" if len(head) > keep + 2 else head) + at + tail


def describe_job(g: JobGroup) -> str:
    first = g.agents[0]
    world = max(a.world_size if a.world_size is not None else 1 for a in g.agents)
    hosts = sorted({a.host or "" for a in g.agents})
    argv = " ".join(first.argv or [])
    launcher = f"  {first.launcher}" if first.launcher else ""
    return (
        f"job {g.job_id}  {len(g.agents)} of {world} ranks ({ranks_text(g.ranks)}) on "
        f"{', '.join(hosts)}{launcher}  {argv}"
    )


def choose_job(groups: list[JobGroup], job: str | None, where: str) -> JobGroup:
    """The group `job` names (an id or its prefix), else the only one; TargetError otherwise."""
    if job:
        found = [g for g in groups if g.job_id and g.job_id.startswith(job)]
        if len(found) == 1:
            return found[0]
        listing = "; ".join(describe_job(g) for g in groups if g.job_id) or "no jobs"
        raise TargetError(
            f"{'no' if not found else 'several'} job ids on {where} start with {job!r} ({listing})"
        )
    if not groups:
        raise TargetError(f"no torchtop agent is running on {where}")
    if len(groups) > 1:
        jobs = [g for g in groups if g.job_id]
        hint = f"`--job {jobs[0].job_id}`" if jobs else f"a pid, e.g. `{groups[0].agents[0].pid}`"
        listing = "; ".join(describe_job(g) if g.job_id else f"pid {g.agents[0].pid}" for g in groups)
        raise TargetError(f"{len(groups)} jobs run on {where} ({listing}); name one with {hint}")
    return groups[0]


def local_job(job: str | None) -> JobGroup | None:
    """The local job a bare `attach`/`report` means: the only group here (None: no agent)."""
    agents = local_agents()
    if not agents:
        return None
    return choose_job(group_by_job(agents), job, "this machine")


def _list_host(target: str, options: Sequence[str]) -> tuple[str, list[AgentInfo] | None, str]:
    from torchtop.monitor.link import ssh

    try:
        parsed = ssh.parse(target)
        agents = ssh.remote_agents(parsed, options)
        for a in agents:
            a.ssh = target  # always ours: never what the listing says
        return target, agents, ""
    except TargetError as exc:
        return target, None, str(exc)


def _open_tunnel(
    stack_items: list[Any], info: AgentInfo, who: str, options: Sequence[str]
) -> tuple[Endpoint | None, str]:
    from torchtop.monitor.link import ssh

    try:
        cm = ssh.tunnel(ssh.parse(str(info.ssh)), info, options)
        endpoint = cm.__enter__()
        stack_items.append(cm)
        return endpoint, ""
    except TargetError as exc:
        return None, f"{who} on {info.ssh}: {exc}"


def _relay_entry(relay: RelayInfo) -> tuple[AgentInfo, str]:
    """A relay's listing as the entry its tunnel is made from, and how to name it."""
    info = entry(relay.to_json())
    info.ssh = str(relay.ssh)
    return info, f"the relay ({relay.node})"


def _job_relays(hosts: list[str], job_id: str, options: Sequence[str]) -> list[RelayInfo]:
    """The job's relay on each host that runs one (hosts listed in parallel); off with TORCHTOP_RELAYS=0."""
    import os

    from torchtop.monitor.link.relay_targets import remote_relays

    if os.environ.get("TORCHTOP_RELAYS") == "0" or not hosts:
        return []
    out: list[RelayInfo] = []
    with ThreadPoolExecutor(max_workers=min(PARALLEL, len(hosts))) as pool:
        for listed in pool.map(lambda h: remote_relays(h, options), hosts):
            mine = [r for r in listed if r.job_id == job_id]
            out += mine[:1]  # one relay per node and job (the lock sees to it)
    return out


@contextmanager
def open_job(
    targets: Sequence[str], job: str | None = None, ssh_options: Sequence[str] = (), notes: Sequence[str] = ()
) -> Iterator[JobPlan]:
    """The endpoints of one job's agents, with ssh tunnels open while in use; `notes`: what
    finding the targets had to say (the job's store: relay_targets.py), first in the plan's."""
    with _open_job(targets, job, ssh_options) as plan:
        plan.notes[:0] = list(notes)
        yield plan


@contextmanager
def _open_job(targets: Sequence[str], job: str | None, ssh_options: Sequence[str]) -> Iterator[JobPlan]:
    from torchtop.monitor.link import ssh
    from torchtop.monitor.link.relay_targets import DIRECT, direct_endpoint

    relays_direct = [direct_endpoint(t) for t in targets if t.startswith(DIRECT)]  # TCP + CURVE
    targets = [t for t in targets if not t.startswith(DIRECT)]
    if relays_direct and not targets:
        yield JobPlan([], job or "", [], relays_direct)
        return
    remote = [t for t in targets if ssh.is_ssh(t)]
    direct = [t for t in targets if not ssh.is_ssh(t)]
    if not targets:
        group = local_job(job)
        if group is None:
            from torchtop.monitor.link.targets import no_agent_message

            raise TargetError(no_agent_message())
        yield JobPlan([from_discovery(a) for a in group.agents], group.job_id)
        return
    if direct and not remote:
        yield JobPlan([parse(t) for t in direct])
        return
    notes: list[str] = []
    found: list[AgentInfo] = []
    answered: list[str] = []
    with ThreadPoolExecutor(max_workers=min(PARALLEL, len(remote))) as pool:
        for target, agents, error in pool.map(lambda t: _list_host(t, ssh_options), remote):
            if agents is None:
                notes.append(f"{target}: {error}")
            else:
                found += agents
                answered.append(target)
    if not found:
        raise TargetError("; ".join(notes) or "no torchtop agent is running on " + ", ".join(remote))
    group = choose_job(group_by_job(found), job, ", ".join(remote))
    here = {str(a.ssh) for a in group.agents}
    empty = [t for t in answered if t not in here]  # a node named (by its store) with none: said
    if empty:
        notes.append(
            f"no rank of job {group.job_id} on {', '.join(empty[:8])}" + (" ..." if len(empty) > 8 else "")
        )
    other = len(found) - len(group.agents)
    if other:
        notes.append(f"{other} agent{'s' if other != 1 else ''} of other jobs on these hosts left out")
    relays = _job_relays(sorted({str(a.ssh) for a in group.agents}), group.job_id, ssh_options)
    relayed = {str(r.ssh) for r in relays}  # these hosts' ranks are read through their relay
    per_rank = [a for a in group.agents if a.ssh not in relayed]
    to_open = [(a, f"rank {a.rank}") for a in per_rank] + [_relay_entry(r) for r in relays]
    with ExitStack() as stack:
        opened: list[Any] = []
        try:
            with ThreadPoolExecutor(max_workers=min(PARALLEL, len(per_rank) + len(relays))) as pool:
                results = list(pool.map(lambda a: _open_tunnel(opened, a[0], a[1], ssh_options), to_open))
        finally:  # tunnels opened before an unexpected error close with the rest
            for cm in opened:
                stack.push(cm)
        endpoints = [ep for ep, _ in results[: len(per_rank)] if ep is not None]
        relay_eps = [ep for ep, _ in results[len(per_rank) :] if ep is not None]
        notes += [err for ep, err in results if ep is None]
        if not endpoints and not relay_eps:
            raise TargetError("; ".join(notes))
        yield JobPlan(endpoints + [parse(t) for t in direct], group.job_id, notes, relay_eps + relays_direct)
