"""Discovery files: how `torchtop ls` and `torchtop attach` find agents on this machine.

Each agent writes `agent-<pid>.json` into a per-user runtime directory (0700, files 0600) and
removes it on exit; its ipc sockets live there too. The directory is checked as private.py
says: another user's directory or symlink is refused, never written into nor chmod'ed, nor read.
A crashed agent leaves its file behind; readers skip (and clean up) files whose process is gone
or whose pid was reused by another process. Imports neither torch nor zmq: the monitor uses it
too.
"""

from __future__ import annotations

import json
import os
import secrets
import tempfile
from pathlib import Path
from typing import Any, cast

from torchtop.agent.contract.private import NotPrivate, create_file, open_private_dir

ENV_DIR = "TORCHTOP_RUNTIME_DIR"


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


def write(info: dict[str, Any]) -> Path:
    """Write this process's discovery file; raise OSError with the path when it cannot."""
    directory = runtime_dir()
    fd = open_runtime_dir()
    try:
        pid = int(info["pid"])
        info = dict(info, proc_start=_process_start_time(pid))
        name, tmp = f"agent-{pid}.json", f".agent-{pid}.{secrets.token_hex(4)}.tmp"
        try:
            out = create_file(fd, tmp)  # O_EXCL|O_NOFOLLOW: a fresh name, never through a link
        except PermissionError:
            raise PermissionError(f"runtime directory {directory} is not writable") from None
        with os.fdopen(out, "w") as fh:
            json.dump(info, fh)
        os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)  # a rename: never follows a link there
        return directory / name
    finally:
        os.close(fd)


def remove(pid: int) -> None:
    try:
        (runtime_dir() / f"agent-{pid}.json").unlink()
    except OSError:
        pass


def _alive(info: dict[str, Any], written: float | None = None) -> bool:
    pid = info.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    started = info.get("proc_start")
    now_started = _process_start_time(pid)
    if now_started is None:
        return True
    if isinstance(started, (int, float)):
        return abs(now_started - started) <= 1.0  # else the pid was reused by another process
    # an older agent's file (no proc_start): its process began before the agent did, and before
    # the file was written; one that began after either is another process with a reused pid
    began = info.get("start_time")
    for t in (began if isinstance(began, (int, float)) else None, written):
        if t is not None and now_started > t + 1.0:
            return False
    return True


def list_agents(clean: bool = True) -> list[dict[str, Any]]:
    """The live agents on this machine, oldest first; stale files are removed when `clean`."""
    directory = runtime_dir()
    try:  # another user's directory (or one they can write) is not read: its entries could lie
        fd = open_private_dir(directory, create=False)
    except OSError:
        return []
    agents: list[dict[str, Any]] = []
    try:
        names = sorted(n for n in os.listdir(fd) if n.startswith("agent-") and n.endswith(".json"))
        for name in names:
            try:
                with os.fdopen(os.open(name, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0), dir_fd=fd)) as fh:
                    written = os.fstat(fh.fileno()).st_mtime
                    raw: Any = json.load(fh)
                if not isinstance(raw, dict):
                    raise ValueError("not an object")
                info = cast("dict[str, Any]", raw)
            except (OSError, ValueError):
                continue
            if _alive(info, written):
                info["file"] = str(directory / name)
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
    agents.sort(key=lambda a: a.get("start_time", 0))
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
