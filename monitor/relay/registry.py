"""Where a node's relays are: `relay-<pid>.json` files beside the agents' discovery files.

The same private runtime directory as the agents' (agent/contract/discovery.py: 0700, files 0600,
another user's directory never read). A relay holds `relay-<job>.lock` (flock) while it runs,
so a node runs one relay per job however many agents or `torchtop run`s try to start one.
`torchtop ls --json --relays` prints these entries for a monitor on another machine.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import secrets
from pathlib import Path

from torchtop.contract import discovery
from torchtop.contract.private import create_file, open_private_dir
from torchtop.contract.relay import RelayInfo, relay_info, relay_line

MAX_FILE = 64 << 10  # a relay's entry is ~400 bytes


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


def write(info: RelayInfo) -> Path:
    directory = discovery.runtime_dir()
    fd = discovery.open_runtime_dir()
    try:
        pid = info.pid
        name, tmp = f"relay-{pid}.json", f".relay-{pid}.{secrets.token_hex(4)}.tmp"
        with os.fdopen(create_file(fd, tmp), "wb") as fh:
            fh.write(relay_line(info))
        os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
        return directory / name
    finally:
        os.close(fd)


def remove(pid: int) -> None:
    try:
        (discovery.runtime_dir() / f"relay-{pid}.json").unlink()
    except OSError:
        pass


def _alive(pid: int) -> bool:
    if not discovery.pid_in_range(pid):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: another user's process holds the pid
        pass
    return True


def _read(fd: int, name: str) -> RelayInfo:
    """One entry, read with care (a same-user file could be anything): the agents' entries' reader
    (a regular file of this user's, at most MAX_FILE bytes, never a link or a FIFO), then checked
    field by field; ValueError says why not."""
    data, _ = discovery.read_small(fd, name, MAX_FILE)
    return relay_info(data)


def list_relays(job_id: str | None = None, skipped: list[str] | None = None) -> list[RelayInfo]:
    """The live relays of this node (of one job when `job_id`); a dead relay's file is removed.
    A file that is not a relay's entry is left as it is, its reason appended to `skipped`."""
    try:
        fd = open_private_dir(discovery.runtime_dir(), create=False)
    except OSError:
        return []
    out: list[RelayInfo] = []
    try:
        for name in sorted(n for n in os.listdir(fd) if n.startswith("relay-") and n.endswith(".json")):
            try:
                info = _read(fd, name)
            except ValueError as exc:
                if skipped is not None:
                    skipped.append(f"{name}: {str(exc)[:200]}")
                continue
            if not _alive(info.pid):
                if name == f"relay-{info.pid}.json":  # ours, and its relay is gone
                    try:
                        os.unlink(name, dir_fd=fd)
                    except OSError:
                        pass
                continue
            if job_id is None or info.job_id == job_id:
                out.append(info)
    finally:
        os.close(fd)
    return out
