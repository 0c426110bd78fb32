"""Discovery files: how `torchtop ls` and `torchtop attach` find agents on this machine.

Each agent writes `agent-<pid>.json` into a per-user runtime directory (0700, files 0600) and
removes it on exit. A crashed agent leaves its file behind; readers skip (and clean up) files
whose process is gone or whose pid was reused by another process. Imports neither torch nor zmq:
the monitor uses it too.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

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


def _make_private(directory: Path) -> None:
    """Ours, with no group/other bits, or refuse: another user could swap our files for theirs."""
    if not hasattr(os, "getuid"):
        return
    st = directory.stat()
    if st.st_uid != os.getuid():
        raise PermissionError(
            f"runtime directory {directory} belongs to another user (uid {st.st_uid}); set "
            f"{ENV_DIR} to a directory of yours"
        )
    if st.st_mode & 0o077:
        os.chmod(directory, st.st_mode & 0o700)  # drop group/other, keep what the owner had


def write(info: dict[str, Any]) -> Path:
    """Write this process's discovery file; raise OSError with the path when it cannot."""
    directory = runtime_dir()
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    _make_private(directory)
    if not os.access(directory, os.W_OK):
        raise PermissionError(f"runtime directory {directory} is not writable")
    pid = int(info["pid"])
    info = dict(info, proc_start=_process_start_time(pid))
    path = directory / f"agent-{pid}.json"
    tmp = directory / f".agent-{pid}.json.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(info, fh)
    os.replace(tmp, path)
    return path


def remove(pid: int) -> None:
    try:
        (runtime_dir() / f"agent-{pid}.json").unlink()
    except OSError:
        pass


def _alive(info: dict[str, Any]) -> bool:
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
    if started is not None and now_started is not None and abs(now_started - started) > 1.0:
        return False  # the pid was reused by another process
    return True


def list_agents(clean: bool = True) -> list[dict[str, Any]]:
    """The live agents on this machine, oldest first; stale files are removed when `clean`."""
    directory = runtime_dir()
    agents = []
    try:
        paths = sorted(directory.glob("agent-*.json"))
    except OSError:
        return []
    for path in paths:
        try:
            info = json.loads(path.read_text())
            if not isinstance(info, dict):
                raise ValueError("not an object")
        except (OSError, ValueError):
            continue
        if _alive(info):
            info["file"] = str(path)
            agents.append(info)
        elif clean:
            try:
                path.unlink()
            except OSError:
                pass
    agents.sort(key=lambda a: a.get("start_time", 0))
    return agents
