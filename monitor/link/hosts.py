"""Host lists for a multi-node job: a file of SSH targets, or a SLURM nodelist. Pure.

--hosts FILE     one target a line: ssh://[user@]host[:port] or a bare host; # comments
--slurm [LIST]   a SLURM nodelist ("gpu[01-04,07],login1"), default $SLURM_JOB_NODELIST
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from torchtop.monitor.link.targets import TargetError

SLURM_VARS = ("SLURM_JOB_NODELIST", "SLURM_NODELIST")
MAX_HOSTS = 1024  # nodes of one job watched at once (each an ssh connection); more is a mistake
MAX_HOSTS_FILE_BYTES = 1 << 20  # ~20,000 lines: a hosts file is never larger
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def as_ssh(word: str) -> str:
    """A bare host becomes ssh://host; an ssh:// target stays as it is."""
    word = word.strip()
    return word if word.lower().startswith("ssh://") else f"ssh://{word}"


def read_hosts_file(path: str) -> list[str]:
    """The targets of a hosts file, in order, without blanks, comments or repeats."""
    try:
        with Path(path).expanduser().open("rb") as fh:  # read at most the cap: /dev/zero never ends
            data = fh.read(MAX_HOSTS_FILE_BYTES + 1)
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        why = getattr(exc, "strerror", None) or exc
        raise TargetError(f"cannot read the hosts file {path!r}: {why}") from None
    if len(data) > MAX_HOSTS_FILE_BYTES:
        raise TargetError(f"the hosts file {path} is over {MAX_HOSTS_FILE_BYTES >> 20} MiB: not a hosts file")
    text = data.decode("utf-8", errors="replace")
    out: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        word = line.split("#", 1)[0].strip()
        if word and not word.isprintable():
            raise TargetError(f"the hosts file {path} line {number}: control characters or binary data")
        if word and as_ssh(word) not in out:
            out.append(as_ssh(word))
            _check_count(len(out), f"the hosts file {path}")
    if not out:
        raise TargetError(f"the hosts file {path} names no host (one ssh://host or host a line)")
    return out


def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def expand_nodelist(nodelist: str) -> list[str]:
    """`gpu[01-03,07],login1` -> gpu01 gpu02 gpu03 gpu07 login1 (zero padding kept)."""
    hosts: list[str] = []
    for part in _split_top(nodelist):
        m = re.match(r"^([^\[\]]*)\[([^\[\]]+)\]([^\[\]]*)$", part)
        if not m:
            if "[" in part or "]" in part:
                raise TargetError(f"cannot read the SLURM nodelist {nodelist!r} at {part!r}")
            hosts.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for r in ranges.split(","):
            rm = _RANGE.match(r.strip())
            if rm is None:
                raise TargetError(f"cannot read the SLURM nodelist {nodelist!r} at {r!r}")
            lo, hi = rm.group(1), rm.group(2) or rm.group(1)
            if int(hi) < int(lo) or int(hi) - int(lo) > 10_000:
                raise TargetError(f"bad range {r!r} in the SLURM nodelist {nodelist!r}")
            width = len(lo)
            _check_count(len(hosts) + int(hi) - int(lo) + 1, f"the SLURM nodelist {nodelist[:80]!r}")
            hosts += [f"{prefix}{n:0{width}d}{suffix}" for n in range(int(lo), int(hi) + 1)]
        _check_count(len(hosts), f"the SLURM nodelist {nodelist[:80]!r}")
    return list(dict.fromkeys(hosts))


def _check_count(n: int, what: str) -> None:
    if n > MAX_HOSTS:
        raise TargetError(f"{what} names over {MAX_HOSTS} hosts: watch at most {MAX_HOSTS} nodes at once")


def slurm_targets(nodelist: str | None, env: Mapping[str, str] | None = None) -> list[str]:
    """ssh:// targets for a nodelist, or for this SLURM job's nodes when none is given."""
    env = os.environ if env is None else env
    if not nodelist:
        nodelist = next((env[v] for v in SLURM_VARS if env.get(v)), "")
    if not nodelist:
        raise TargetError(
            "--slurm: no nodelist given and SLURM_JOB_NODELIST is not set (run inside the job's "
            "allocation, or pass --slurm 'gpu[01-04]')"
        )
    return [as_ssh(h) for h in expand_nodelist(nodelist)]
