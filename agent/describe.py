"""How an agent describes itself: its Hello (a monitor's first question), its discovery file's
entry (how local monitors find and reach it) and the line it prints when it starts."""

from __future__ import annotations

import socket
import sys
from typing import TYPE_CHECKING

from torchtop.contract import discovery, wire

if TYPE_CHECKING:
    from torchtop.agent.core import Agent

VERSION = "0.1.0"


def device(agent: Agent) -> tuple[str, str]:
    """("cuda"|"cpu", device name) judged from the model's parameters, else CUDA's state."""
    torch = agent.torch
    for module in agent.hooks.root_modules() if agent.hooks else []:
        try:
            param = next(module.parameters())
        except (StopIteration, Exception):  # broad: a module that cannot list its parameters: the next one
            continue
        if param.device.type == "cuda":
            return "cuda", torch.cuda.get_device_name(param.device)
        return param.device.type, ""
    try:
        if torch.cuda.is_initialized():
            return "cuda", torch.cuda.get_device_name()
    except Exception:  # broad: CUDA that cannot say is taken as not in use
        pass
    return "cpu", ""


def hello(agent: Agent) -> wire.Hello:
    device_type, name = device(agent)
    return wire.Hello(
        v=wire.PROTOCOL_VERSION,
        run_id=agent.run_id,
        pid=agent.pid,
        host=socket.gethostname(),
        port=agent.port,
        pub_port=agent.sockets.pub_port,
        device=device_type,
        device_name=name,
        start_time=agent.start_time,
        rank=agent.rank,
        world_size=agent.world_size,
        local_rank=agent.local_rank,
        torch_version=str(getattr(agent.torch, "__version__", "")),
        agent_version=VERSION,
        argv=list(sys.argv),
        cuda_event_every=agent.probe.event_every if agent.probe.pool is not None else 0,
        job_id=agent.identity.job_id,
        launcher=agent.identity.launcher,
        node_rank=agent.identity.node_rank,
        local_world_size=agent.identity.local_world_size,
        backend=agent.identity.backend,
    )


def discovery_info(agent: Agent) -> discovery.AgentInfo:
    """What the discovery file holds (0600): how local monitors of this user find and reach us."""
    sockets = agent.sockets
    client = sockets.client
    return discovery.AgentInfo(
        pid=agent.pid,
        host=socket.gethostname(),
        transport=sockets.transport,
        address=sockets.address,
        pub_address=sockets.pub_address,
        bind=sockets.bind,
        port=agent.port or None,
        pub_port=sockets.pub_port or None,
        rank=agent.rank,
        world_size=agent.world_size,
        local_rank=agent.local_rank,
        local_world_size=agent.identity.local_world_size,
        node_rank=agent.identity.node_rank,
        job_id=agent.identity.job_id,
        launcher=agent.identity.launcher,
        argv=list(sys.argv),
        start_time=agent.start_time,
        run_id=agent.run_id,
        version=VERSION,
        # CURVE (TCP): the agent's public key, and the key pair it admits for this user's
        # monitors. The secret is why this file is 0600 in a 0700 directory.
        server_key=sockets.curve.public.decode() if sockets.curve else None,
        client_key=client[0].decode() if client else None,
        client_secret=client[1].decode() if client else None,
    )


def where(agent: Agent) -> str:
    """The start line: where to attach (to the job, when this is rank 0 of several)."""
    rec = agent.recorder
    recording = ""
    if rec is not None:  # no directory yet: no launcher named the rank, the process group will
        recording = f"; recording to {rec.directory or str(rec.path) + ' (its rank directory once known)'}"
    if agent.world_size > 1:
        return (
            f"agents on the {agent.world_size} ranks of this job (rank 0: pid {agent.pid} on {agent.sockets.address}); "
            f"attach with: torchtop attach (the job's machine), torchtop attach {agent.pid} (rank 0){recording}"
        )
    return f"agent on {agent.sockets.address} (pid {agent.pid}); attach with: torchtop attach {agent.pid}{recording}"
