"""Discovery files: how `torchtop ls` and `torchtop attach` find agents on this machine.

Each agent writes `agent-<pid>.json` into a per-user runtime directory (0700, files 0600) and
removes it on exit; its ipc sockets live there too. The directory is checked as private.py
says: another user's directory or symlink is refused, never written into nor chmod'ed, nor read.
A crashed agent leaves its file behind; readers skip (and clean up) files whose process is gone
or whose pid was reused by another process. Imports neither torch nor zmq: the monitor uses it
too.

An entry is an `AgentInfo`: the file holds its fields but the reader-side ones (`file`, `unusable`,
`ssh`), `torchtop ls --json` prints it with `file` too. Every field has a default, so an older
agent's file (fewer fields) still reads; fields a newer agent adds are ignored. A file whose
object has a wrongly typed field is still listed when its pid is an int: with the fields that do
read and the reason in `unusable`, so the monitor names it in one line (targets.from_discovery).
"""

from __future__ import annotations

import json
import os
import secrets
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import msgspec

from torchtop.contract.private import NotPrivate, create_file, open_private_dir

ENV_DIR = "TORCHTOP_RUNTIME_DIR"


class AgentInfo(msgspec.Struct, forbid_unknown_fields=False):
    """One agent's discovery entry: how local monitors of this user find and reach it (0600).
    In the order the file holds them; None: not known (not written by that agent, or not set)."""

    pid: int | None = None
    host: str | None = None
    transport: str | None = None  # "ipc" | "tcp"
    address: str | None = None  # the request socket (older agents: bind and port only)
    pub_address: str | None = None  # the batch stream
    bind: str | None = None
    port: int | None = None
    pub_port: int | None = None
    rank: int | None = None
    world_size: int | None = None
    local_rank: int | None = None
    local_world_size: int | None = None
    node_rank: int | None = None
    job_id: str | None = None  # "" or None: a process on its own
    launcher: str | None = None
    argv: list[str] | None = None
    start_time: float | None = None
    run_id: str | None = None
    version: str | None = None
    # CURVE (TCP): the agent's public key, and the key pair it admits for this user's monitors.
    # The secret is why the file is 0600 in a 0700 directory.
    server_key: str | None = None
    client_key: str | None = None
    client_secret: str | None = None
    proc_start: float | None = None  # its process's start (psutil), set by write(): a reused pid
    # reader side, never in the file: where it was read, why it cannot be used, the ssh target
    # (monitor) through which another machine's listing gave it
    file: str | None = None
    unusable: str | None = None
    ssh: str | None = None


_READER_SIDE = ("file", "unusable", "ssh")


def entry(raw: Mapping[str, Any]) -> AgentInfo:
    """The AgentInfo of a JSON object (a discovery file, a line of another machine's `ls --json`).
    A wrongly typed field does not fail it: the fields that read are kept, the reason goes into
    `unusable`. The `ssh` field is never taken from the object."""
    try:
        info = msgspec.convert(raw, AgentInfo)
    except msgspec.ValidationError as exc:
        good: dict[str, Any] = {}
        for name in AgentInfo.__struct_fields__:
            if name in raw:
                try:
                    msgspec.convert({name: raw[name]}, AgentInfo)
                except msgspec.ValidationError:
                    continue
                good[name] = raw[name]
        info = msgspec.convert(good, AgentInfo)
        info.unusable = info.unusable or str(exc)
    info.ssh = None
    return info


def file_dict(info: AgentInfo) -> dict[str, Any]:
    """What the discovery file holds: every field but the reader-side ones."""
    out = cast("dict[str, Any]", msgspec.to_builtins(info))
    for name in _READER_SIDE:
        out.pop(name, None)
    return out


def listing(info: AgentInfo) -> dict[str, Any]:
    """The entry as `torchtop ls --json` prints it: the file's fields and `file` (and `unusable`
    when it is)."""
    out = file_dict(info) | {"file": info.file}
    if info.unusable is not None:
        out["unusable"] = info.unusable
    return out


def runtime_dir() -> Path:
    """$TORCHTOP_RUNTIME_DIR, else $XDG_RUNTIME_DIR/torchtop, else <tmp>/torchtop-<uid>."""
    explicit = os.environ.get(ENV_DIR)
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK):
        return Path(xdg) / "torchtop"
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"torchtop-{uid}"


def _process_start_time(pid: int) -> float | None:
    try:
        import psutil

        return psutil.Process(pid).create_time()
    except Exception:
        return None


def open_runtime_dir(create: bool = True) -> int:
    """The runtime directory, verified ours and narrowed to 0700 (created when missing), as an
    O_DIRECTORY descriptor; PermissionError (NotPrivate) saying what to do when it is not ours."""
    directory = runtime_dir()
    try:
        return open_private_dir(directory, create=create, narrow=True)
    except NotPrivate as exc:
        raise NotPrivate(f"runtime directory {exc}; set {ENV_DIR} to a directory of yours") from None


def write(info: AgentInfo) -> Path:
    """Write this process's discovery file; raise OSError with the path when it cannot."""
    if not isinstance(info.pid, int):
        raise ValueError("a discovery entry names its pid")
    directory = runtime_dir()
    fd = open_runtime_dir()
    try:
        pid = info.pid
        document = file_dict(msgspec.structs.replace(info, proc_start=_process_start_time(pid)))
        name, tmp = f"agent-{pid}.json", f".agent-{pid}.{secrets.token_hex(4)}.tmp"
        try:
            out = create_file(fd, tmp)  # O_EXCL|O_NOFOLLOW: a fresh name, never through a link
        except PermissionError:
            raise PermissionError(f"runtime directory {directory} is not writable") from None
        with os.fdopen(out, "w") as fh:
            json.dump(document, fh)
        os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)  # a rename: never follows a link there
        return directory / name
    finally:
        os.close(fd)


def remove(pid: int) -> None:
    try:
        (runtime_dir() / f"agent-{pid}.json").unlink()
    except OSError:
        pass


def _alive(info: AgentInfo, written: float | None = None) -> bool:
    pid = info.pid
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    started = info.proc_start
    now_started = _process_start_time(pid)
    if now_started is None:
        return True
    if isinstance(started, (int, float)):
        return abs(now_started - started) <= 1.0  # else the pid was reused by another process
    # an older agent's file (no proc_start): its process began before the agent did, and before
    # the file was written; one that began after either is another process with a reused pid
    began = info.start_time
    for t in (began if isinstance(began, (int, float)) else None, written):
        if t is not None and now_started > t + 1.0:
            return False
    return True


def list_agents(clean: bool = True) -> list[AgentInfo]:
    """The live agents on this machine, oldest first, each with its `file`; stale files are
    removed when `clean`. Files that are not JSON objects are skipped."""
    directory = runtime_dir()
    try:  # another user's directory (or one they can write) is not read: its entries could lie
        fd = open_private_dir(directory, create=False)
    except OSError:
        return []
    agents: list[AgentInfo] = []
    try:
        names = sorted(n for n in os.listdir(fd) if n.startswith("agent-") and n.endswith(".json"))
        for name in names:
            try:
                with os.fdopen(os.open(name, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0), dir_fd=fd)) as fh:
                    written = os.fstat(fh.fileno()).st_mtime
                    raw: Any = json.load(fh)
                if not isinstance(raw, dict):
                    raise ValueError("not an object")
                info = entry(cast("dict[str, Any]", raw))
            except (OSError, ValueError):
                continue
            if _alive(info, written):
                info.file = str(directory / name)
                agents.append(info)
            elif clean:
                try:
                    os.unlink(name, dir_fd=fd)
                except OSError:
                    pass
        if clean:
            _clean_sockets(fd)
    except OSError:
        return []
    finally:
        os.close(fd)
    agents.sort(key=lambda a: a.start_time if a.start_time is not None else 0)
    return agents


def _clean_sockets(fd: int) -> None:
    """Remove the ipc socket files (agent-<pid>.req / .pub) a killed agent left: only sockets of
    this user, only where no process has that pid."""
    import stat

    uid = os.geteuid() if hasattr(os, "geteuid") else None
    for name in os.listdir(fd):
        stem, _, kind = name.rpartition(".")
        pid_text = stem.removeprefix("agent-")
        if kind not in ("req", "pub") or not stem.startswith("agent-") or not pid_text.isdigit():
            continue
        if _running(int(pid_text)):
            continue
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISSOCK(st.st_mode) and (uid is None or st.st_uid == uid):
                os.unlink(name, dir_fd=fd)
        except OSError:
            pass


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # another user's process (or a pid no process can have): left alone
    return True
