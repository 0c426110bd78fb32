"""Where a node's relays are: `relay-<pid>.json` files beside the agents' discovery files.

The same private runtime directory as the agents' (agent/contract/discovery.py: 0700, files 0600,
another user's directory never read). A relay holds `relay-<job>.lock` (flock) while it runs,
so a node runs one relay per job however many agents or `torchtop run`s try to start one.
`torchtop ls --json --relays` prints these entries for a monitor on another machine.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import secrets
from pathlib import Path
from typing import Any

from torchtop.contract import discovery
from torchtop.contract.private import create_file, open_private_dir


def job_tag(job_id: str) -> str:
    """A short, file-name-safe tag of a job id (socket paths must stay short)."""
    return hashlib.sha1(job_id.encode()).hexdigest()[:10]


def lock(job_id: str) -> int | None:
    """Hold this node's relay lock of the job: a descriptor, or None when another relay holds it."""
    fd_dir = discovery.open_runtime_dir()
    try:
        fd = os.open(
            f"relay-{job_tag(job_id)}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600, dir_fd=fd_dir
        )
    finally:
        os.close(fd_dir)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def write(info: dict[str, Any]) -> Path:
    directory = discovery.runtime_dir()
    fd = discovery.open_runtime_dir()
    try:
        pid = int(info["pid"])
        name, tmp = f"relay-{pid}.json", f".relay-{pid}.{secrets.token_hex(4)}.tmp"
        with os.fdopen(create_file(fd, tmp), "w") as fh:
            json.dump(info, fh)
        os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
        return directory / name
    finally:
        os.close(fd)


def remove(pid: int) -> None:
    try:
        (discovery.runtime_dir() / f"relay-{pid}.json").unlink()
    except OSError:
        pass


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def list_relays(job_id: str | None = None) -> list[dict[str, Any]]:
    """The live relays of this node (of one job when `job_id`); a dead relay's file is removed."""
    try:
        fd = open_private_dir(discovery.runtime_dir(), create=False)
    except OSError:
        return []
    out = []
    try:
        for name in sorted(n for n in os.listdir(fd) if n.startswith("relay-") and n.endswith(".json")):
            try:
                with os.fdopen(os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=fd)) as fh:
                    info = json.load(fh)
            except (OSError, ValueError):
                continue
            if not isinstance(info, dict):
                continue
            if not _alive(info.get("pid")):
                try:
                    os.unlink(name, dir_fd=fd)
                except OSError:
                    pass
                continue
            if job_id is None or info.get("job_id") == job_id:
                out.append(info)
    finally:
        os.close(fd)
    return out
