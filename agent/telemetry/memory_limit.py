"""What this process's memory may reach: the time-to-limit forecast's ceiling, and the automatic
memory snapshot's trigger (issue 38).

On the host: the smallest of the cgroup's limit (v2 memory.max, v1 memory.limit_in_bytes, over
the process's cgroup and its ancestors: a parent's limit binds too), RLIMIT_AS / RLIMIT_DATA
where set, and the machine's memory; and the limit the user sets (TORCHTOP_MEMORY_LIMIT or
start(memory_limit=), bytes or "12GiB"). Read on the agent's threads (collector.py), never the
training thread; a few small files, every LIMIT_PERIOD_S. Never raises.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from torchtop.contract.wire import MemoryLimit

LIMIT_PERIOD_S = 10.0  # a cgroup's limit can be changed while the run goes on
# a v1 cgroup without a limit reads as the largest page-aligned 64-bit number, ~2**63
UNLIMITED = 1 << 60
_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40,
}  # fmt: skip
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?(?:e[0-9]+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_size(text: str | int | float | None) -> int | None:
    """Bytes from 12884901888, "12GiB", "12 G" (decimal), "1.5e9"; None when not a positive size."""
    if text is None or isinstance(text, bool):
        return None
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = _SIZE.fullmatch(text[:64])
        if m is None or m.group(2).lower() not in _UNITS:
            return None
        try:
            value = float(m.group(1)) * _UNITS[m.group(2).lower()]
        except (OverflowError, ValueError):
            return None
    if not 0 < value < UNLIMITED:
        return None
    return int(value)


def _read_int(path: Path) -> int | None:
    """A cgroup file's number; None for "max", unlimited, absent or unreadable."""
    try:
        text = path.read_bytes()[:64].decode("ascii", "replace").strip()
    except OSError:
        return None
    if not text.isdigit():
        return None  # "max": no limit
    value = int(text)
    return value if 0 < value < UNLIMITED else None


def _ancestors(root: Path, rel: str) -> list[Path]:
    """`root/rel` and each of its parents up to `root`, deepest first (a relative cgroup path
    never climbs out of `root`)."""
    parts = [p for p in rel.strip("/").split("/") if p and p not in (".", "..")]
    return [root.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def cgroup_limit(
    root: str = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup"
) -> tuple[int, str] | None:
    """The tightest memory limit of this process's cgroup (v2, else v1) and its ancestors, with
    its name; None where there is none or cgroups cannot be read."""
    try:
        lines = Path(self_cgroup).read_bytes()[:8192].decode("utf-8", "replace").splitlines()
    except OSError:
        lines = []
    base = Path(root)
    found: list[tuple[int, str]] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, rel = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # v2, the unified hierarchy
            paths, name, where = _ancestors(base, rel), "memory.max", base
        elif "memory" in controllers.split(","):  # v1's memory controller
            where = base / "memory"
            paths, name = _ancestors(where, rel), "memory.limit_in_bytes"
        else:
            continue
        # in a container the process's own path may not exist under the mount: its root is the cgroup
        for p in [*paths, where]:
            v = _read_int(p / name)
            if v is not None:
                found.append((v, f"cgroup {name}"))
    if not lines:  # no /proc: the mount's own files, if any
        for name, where in (("memory.max", base), ("memory.limit_in_bytes", base / "memory")):
            v = _read_int(where / name)
            if v is not None:
                found.append((v, f"cgroup {name}"))
    return min(found) if found else None


def rlimit() -> tuple[int, str] | None:
    """The smaller of RLIMIT_AS and RLIMIT_DATA where set (soft limits: what the kernel enforces)."""
    try:
        import resource
    except ImportError:  # not POSIX
        return None
    found: list[tuple[int, str]] = []
    for name in ("RLIMIT_AS", "RLIMIT_DATA"):
        which = getattr(resource, name, None)
        if which is None:
            continue
        try:
            soft, _ = resource.getrlimit(which)
        except (OSError, ValueError):
            continue
        if soft != resource.RLIM_INFINITY and 0 < soft < UNLIMITED:
            found.append((soft, name))
    return min(found) if found else None


def machine_total() -> int | None:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None
    return total if total > 0 else None


def read_limit(
    user: int | None, root: str = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup"
) -> MemoryLimit:
    """The process's memory limit: the smallest of the host's and the user's (`user` bytes)."""
    found: list[tuple[int, str]] = []
    for got in (cgroup_limit(root, self_cgroup), rlimit()):
        if got is not None:
            found.append(got)
    total = machine_total()
    if total is not None:
        found.append((total, "machine"))
    if user:
        found.append((user, "TORCHTOP_MEMORY_LIMIT"))
    if not found:
        return MemoryLimit(user=user or 0)
    limit, source = min(found)
    return MemoryLimit(limit=limit, source=source, user=user or 0)
