"""Discovery files: how `torchtop ls` and `torchtop attach` find agents on this machine.

Each agent writes `agent-<pid>.json` into a per-user runtime directory (0700, files 0600) and
removes it on exit; its ipc sockets live there too. The directory is checked as private.py
says: another user's directory or symlink is refused, never written into nor chmod'ed, nor read.
A crashed agent leaves its file behind; readers skip (and clean up) files whose process is gone
or whose pid was reused by another process. Imports neither torch nor zmq: the monitor uses it
too.

Anything of this user's can write a file there, so a reader trusts none: it opens a regular file
only (never a link, FIFO or device), reads at most MAX_FILE_BYTES, decodes with msgspec (deep
nesting is a RecursionError, caught) and range-checks every field (a pid within pid_max, ports,
lengths). A file that fails is skipped with its reason (`scan`, `torchtop ls`), never raised, and
deleted only when it is an entry of ours (named by its pid) whose process is gone.

An entry is an `AgentInfo`: the file holds its fields but the reader-side ones (`file`, `unusable`,
`ssh`), `torchtop ls --json` prints it with `file` too. Every field has a default, so an older
agent's file (fewer fields) still reads; fields a newer agent adds are ignored. A file whose
object has a wrongly typed field is still listed when its pid is an int: with the fields that do
read and the reason in `unusable`, so the monitor names it in one line (targets.from_discovery).
"""

from __future__ import annotations

import errno
import functools
import json
import os
import secrets
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, NamedTuple, cast

import msgspec

from torchtop.contract.private import NotPrivate, create_file, open_private_dir

ENV_DIR = "TORCHTOP_RUNTIME_DIR"
MAX_FILE_BYTES = 64 << 10  # an entry is about 1 KiB: a bigger file is not one
MAX_TEXT = 1024  # a host, an id, a name, a key
MAX_ADDRESS = 255
IPC_PATH_MAX = 107  # sun_path holds 108 bytes with its NUL: a longer path is no socket
MAX_WORD, MAX_WORDS = 4096, 256  # argv, as the agent writes it (clipped to fit)
PID_CEILING = 1 << 22  # Linux's highest pid_max

Pid = Annotated[int, msgspec.Meta(ge=1, le=PID_CEILING)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
Count = Annotated[int, msgspec.Meta(ge=0, le=(1 << 31) - 1)]  # ranks and sizes
Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT)]
Address = Annotated[str, msgspec.Meta(max_length=MAX_ADDRESS)]
Word = Annotated[str, msgspec.Meta(max_length=MAX_WORD)]
UnixTime = Annotated[float, msgspec.Meta(ge=0.0, le=1e11)]  # finite, before the year 5000


class AgentInfo(msgspec.Struct, forbid_unknown_fields=False):
    """One agent's discovery entry: how local monitors of this user find and reach it (0600).
    In the order the file holds them; None: not known (not written by that agent, or not set)."""

    pid: Pid | None = None
    host: Text | None = None
    transport: Text | None = None  # "ipc" | "tcp"
    address: Address | None = None  # the request socket (older agents: bind and port only)
    pub_address: Address | None = None  # the batch stream
    bind: Text | None = None
    port: Port | None = None
    pub_port: Port | None = None
    rank: Count | None = None
    world_size: Count | None = None
    local_rank: Count | None = None
    local_world_size: Count | None = None
    node_rank: Count | None = None
    job_id: Text | None = None  # "" or None: a process on its own
    launcher: Text | None = None
    argv: Annotated[list[Word], msgspec.Meta(max_length=MAX_WORDS)] | None = None
    start_time: UnixTime | None = None
    run_id: Text | None = None
    version: Text | None = None
    # CURVE (TCP): the agent's public key, and the key pair it admits for this user's monitors.
    # The secret is why the file is 0600 in a 0700 directory.
    server_key: Text | None = None
    client_key: Text | None = None
    client_secret: Text | None = None
    proc_start: UnixTime | None = None  # its process's start (psutil), set by write(): a reused pid
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
    if info.unusable is None:
        info.unusable = _address_problem(info)
    return info


def _address_problem(info: AgentInfo) -> str | None:
    """Why an entry's addresses cannot be sockets (an ipc path past sun_path's bytes, a control
    character), else None: zmq would raise on them instead of saying so."""
    for name in ("address", "pub_address"):
        address: str | None = getattr(info, name)
        if address is None:
            continue
        if not address.isprintable():
            return f"{name} holds control characters"
        path = address.removeprefix("ipc://")
        if path != address and len(path.encode("utf-8", "surrogatepass")) > IPC_PATH_MAX:
            return f"{name} is an ipc path of more than {IPC_PATH_MAX} bytes"
    return None


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
    except Exception:  # broad: psutil missing or the process gone: unknown
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
        argv = _clip(info.argv) if info.argv is not None else None
        document = file_dict(msgspec.structs.replace(info, proc_start=_process_start_time(pid), argv=argv))
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


def _clip(argv: list[str]) -> list[str]:
    """argv cut to what a reader accepts (MAX_WORD, MAX_WORDS, half of MAX_FILE_BYTES in all)."""
    out: list[str] = []
    room = MAX_FILE_BYTES // 2
    for word in argv[:MAX_WORDS]:
        word = word[:MAX_WORD]
        room -= len(json.dumps(word))
        if room < 0:
            break
        out.append(word)
    return out


def remove(pid: int) -> None:
    try:
        (runtime_dir() / f"agent-{pid}.json").unlink()
    except OSError:
        pass


@functools.cache
def pid_max() -> int:
    """This machine's highest pid (/proc/sys/kernel/pid_max), else Linux's ceiling."""
    try:
        with open("/proc/sys/kernel/pid_max", "rb") as fh:
            value = int(fh.read(32).strip())
    except (OSError, ValueError):
        return PID_CEILING
    return value if 0 < value <= PID_CEILING else PID_CEILING


def pid_in_range(pid: object) -> bool:
    """Whether `pid` could be a process's (an int in 1..pid_max): os.kill on it cannot overflow."""
    return isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid <= pid_max()


def _alive(info: AgentInfo, written: float | None = None) -> bool:
    pid = info.pid
    if pid is None or not pid_in_range(pid):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass  # EPERM: exists, owned by someone else
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


class Skipped(NamedTuple):
    """A file in the runtime directory that is no agent's entry, and why (one line)."""

    file: str
    reason: str


def read_small(dir_fd: int, name: str, limit: int = MAX_FILE_BYTES) -> tuple[bytes, os.stat_result]:
    """A regular file of this user's, of at most `limit` bytes, and its stat; ValueError says
    why not. Never follows a link, never blocks on a FIFO, never reads a device."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        raise ValueError(
            "a symbolic link" if exc.errno == errno.ELOOP else (exc.strerror or str(exc))
        ) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
            raise ValueError(f"owned by uid {st.st_uid}, not this user")
        if st.st_size > limit:
            raise ValueError(f"{st.st_size:,} bytes, more than an entry's {limit:,}")
        data = os.read(fd, limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise ValueError(f"more than an entry's {limit:,} bytes")
    return data, st


def read_entry(dir_fd: int, name: str) -> tuple[AgentInfo, float]:
    """The entry in file `name` and when it was written; ValueError says why it is not one."""
    data, st = read_small(dir_fd, name)
    try:
        raw: Any = msgspec.json.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:  # deep nesting: RecursionError
        raise ValueError(f"not JSON ({str(exc)[:80]})") from None
    if not isinstance(raw, dict):
        raise ValueError("not a JSON object")
    return entry(cast("dict[str, Any]", raw)), st.st_mtime


def scan(clean: bool = True) -> tuple[list[AgentInfo], list[Skipped]]:
    """The live agents on this machine, oldest first, each with its `file`, and the files that
    are not entries with why. A stale entry of ours (named by its pid, its process gone) is
    removed when `clean`; nothing else is."""
    directory = runtime_dir()
    try:  # another user's directory (or one they can write) is not read: its entries could lie
        fd = open_private_dir(directory, create=False)
    except OSError:
        return [], []
    agents: list[AgentInfo] = []
    skipped: list[Skipped] = []
    try:
        names = sorted(n for n in os.listdir(fd) if n.startswith("agent-") and n.endswith(".json"))
        for name in names:
            try:
                info, written = read_entry(fd, name)
                if info.pid is None:
                    raise ValueError(info.unusable or "names no pid")
                if info.pid > pid_max():
                    raise ValueError(f"pid {info.pid} is above this machine's pid_max {pid_max()}")
            except ValueError as exc:
                skipped.append(Skipped(str(directory / name), str(exc)[:200]))
                continue
            if _alive(info, written):
                info.file = str(directory / name)
                agents.append(info)
            elif clean and name == f"agent-{info.pid}.json":
                try:
                    os.unlink(name, dir_fd=fd)
                except OSError:
                    pass
        if clean:
            _clean_sockets(fd)
    except OSError:
        return [], []
    finally:
        os.close(fd)
    agents.sort(key=lambda a: a.start_time if a.start_time is not None else 0)
    return agents, skipped


def list_agents(clean: bool = True) -> list[AgentInfo]:
    """The live agents on this machine, oldest first (`scan` without the skipped files)."""
    return scan(clean)[0]


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
