"""Who this process is in its job: rank, local rank, world size, node, and the job's id.

Read from the launcher's environment when the agent starts (torchrun/torchelastic, SLURM, or the
plain torch.distributed variables), then completed by the agent thread from torch.distributed
itself once the process group exists (a job started with mp.spawn and init_process_group(rank=...)
has no variables). The job id is what the ranks of one job share and no other job on the machine
does: torchelastic's run id, the SLURM job and step, and the rendezvous address (MASTER_ADDR and
MASTER_PORT, or the default store's host and port), joined. Never raises.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    try:
        return int(env.get(name, default))
    except (TypeError, ValueError):
        return default


def _known(env: Mapping[str, str], name: str) -> int | None:
    """The variable as an int; None where it is unset or not a number (unknown)."""
    try:
        return int(env[name])
    except (KeyError, TypeError, ValueError):
        return None


@dataclass
class Identity:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 0  # 0: unknown
    node_rank: int | None = None  # None: unknown
    job_id: str = ""  # "": a process on its own
    launcher: str = ""  # "torchrun" | "slurm" | "torch.distributed" | ""
    backend: str = ""  # set once the default process group is seen


def from_env(env: Mapping[str, str] | None = None) -> Identity:
    """The identity the launcher's variables give (pure: `env` defaults to os.environ)."""
    env = os.environ if env is None else env
    ident = Identity()
    slurm = "SLURM_PROCID" in env and "SLURM_JOB_ID" in env
    torchrun = "TORCHELASTIC_RUN_ID" in env or "GROUP_RANK" in env
    if "RANK" in env or "WORLD_SIZE" in env:
        ident.rank = _int(env, "RANK", 0)
        ident.world_size = _int(env, "WORLD_SIZE", 1)
        ident.local_rank = _int(env, "LOCAL_RANK", 0)
        ident.local_world_size = _int(env, "LOCAL_WORLD_SIZE", 0)
        ident.node_rank = _known(env, "GROUP_RANK")
        ident.launcher = "torchrun" if torchrun else "torch.distributed"
    elif slurm:  # srun launched the ranks itself
        ident.rank = _int(env, "SLURM_PROCID", 0)
        ident.world_size = _int(env, "SLURM_NTASKS", 1)
        ident.local_rank = _int(env, "SLURM_LOCALID", 0)
        ident.launcher = "slurm"
    if slurm and ident.node_rank is None:
        ident.node_rank = _known(env, "SLURM_NODEID")
    parts = []
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":  # torchrun's default rdzv id is the word "none"
        parts.append(run_id)
    if slurm:
        parts.append(f"slurm-{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', '0')}")
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        parts.append(f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}")
    if parts and (ident.world_size > 1 or ident.launcher):
        ident.job_id = "@".join(parts)
    return ident


def refresh_from_dist(ident: Identity, torch: Any) -> bool:
    """Agent thread, at a low rate: fill in what torch.distributed knows once its default group
    is initialized (rank, world size, backend, the store's address as the job id where the
    environment gave none). True when something changed. Cheap once done: the caller stops
    asking after the backend is known."""
    try:
        dist = getattr(torch, "distributed", None)
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return False
        changed = False
        rank, world = int(dist.get_rank()), int(dist.get_world_size())
        if (rank, world) != (ident.rank, ident.world_size):
            ident.rank, ident.world_size, changed = rank, world, True
        backend = str(dist.get_backend())
        if backend != ident.backend:
            ident.backend, changed = backend, True
        if not ident.launcher:
            ident.launcher, changed = "torch.distributed", True
        if not ident.job_id and world > 1:
            address = _store_address(dist)
            if address:
                ident.job_id, changed = address, True
        return changed
    except Exception:  # broad: a process group that cannot say: the identity stays
        return False


def _store_address(dist: Any) -> str:
    """host:port of the default group's TCPStore (every rank of the job connects to it)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        while hasattr(store, "underlying_store"):  # PrefixStore around the TCPStore
            store = store.underlying_store
        host, port = getattr(store, "host", ""), getattr(store, "port", 0)
        return f"{host}:{port}" if host and port else ""
    except Exception:  # broad: store internals vary by version: no address
        return ""
