"""A node's relay and its monitors: what a relay registers (RelayInfo) and what it sends of each
rank per second (Second), as named, typed, append-only fields.

A relay publishes each rank's 1-second sums (monitor/model/rank_stats.py's slots, in that order)
inside wire.NodeSummary. Second is array_like: it travels as the list of numbers it was before it
had names, so a monitor reads a relay from either side of a change:
- a shorter one (an older relay): the missing fields are 0, and every group of figures has its
  own count (steps, timed, sampled, worked), so a group that counted 0 steps is unknown, not 0 ms;
- a longer one (a newer relay): the fields this side does not know are ignored.
Append-only: a new figure goes last with a default of 0 (after its own count, if its steps are
not all counted by `steps`), and SUMMARY_VERSION goes up (CONTRIBUTING: a new per-rank job figure).
Both are validated where they arrive (`second_problem`, `relay_info`): a relay's word is a peer's.
Imports only msgspec and the standard library.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import msgspec

from torchtop.contract.discovery import PID_CEILING

#: 1: an unnamed list [second, *sums] (18 sums before the work figures, then 22); 2: Second;
#: 3: checkpoint_ns
SUMMARY_VERSION = 3
SECONDS_BACK = 130.0  # a summary's oldest second: the monitor keeps 120 s of seconds
SECONDS_AHEAD = 5.0  # its newest, past the relay's clock at sending (a step's end rounds up)
MAX_STEPS_A_SECOND = 1_000_000  # far above any real loop (a step of a microsecond)


class Second(msgspec.Struct, array_like=True):
    """One rank's train steps that ended within one wall-clock second: counts and sums."""

    t: float  # the second (unix, whole; a float on the wire since version 1)
    steps: float = 0.0
    wall_ns: float = 0.0  # their wall time
    timed: float = 0.0  # steps whose phases were timed
    timed_wall_ns: float = 0.0
    data_ns: float = 0.0  # each phase's host time over the timed steps (PHASES' order; checkpoint last)
    h2d_ns: float = 0.0
    forward_ns: float = 0.0
    backward_ns: float = 0.0
    optimizer_ns: float = 0.0
    comm_ns: float = 0.0
    other_ns: float = 0.0  # outside the phases: what the verdict's outside-phases share reads
    sampled: float = 0.0  # steps with CUDA device times
    dev_h2d_ms: float = 0.0  # device ms per key over the sampled steps
    dev_forward_ms: float = 0.0
    dev_backward_ms: float = 0.0
    dev_optimizer_ms: float = 0.0
    dev_comm_ms: float = 0.0
    dev_step_ms: float = 0.0
    worked: float = 0.0  # steps whose batch was seen (hooks/work.py)
    samples: float = 0.0
    tokens: float = 0.0
    seq: float = 0.0  # the longest sequence, summed
    checkpoint_ns: float = 0.0  # the `checkpoint` phase over the timed steps (an older relay: 0)


SECOND_FIELDS: tuple[str, ...] = Second.__struct_fields__
#: each count and the sums over the steps it counts (every count is of `steps`, at most)
COUNTS: dict[str, tuple[str, ...]] = {
    "steps": ("wall_ns",),
    "timed": (*SECOND_FIELDS[4:12], "checkpoint_ns"),
    "sampled": SECOND_FIELDS[13:19],
    "worked": SECOND_FIELDS[20:24],
}


def second_problem(s: Second, ref: float) -> str | None:
    """Why a relay's second is not taken (None: it is): whole counts within their steps, no figure
    below 0, the second near `ref` (the relay's clock when it sent the summary)."""
    if s.t != int(s.t) or not ref - SECONDS_BACK <= s.t <= ref + SECONDS_AHEAD:
        return f"a second at {s.t:.0f}, {s.t - ref:+.0f} s from the summary's time"
    values: tuple[float, ...] = msgspec.structs.astuple(s)
    low = min(values[1:])
    if low < 0:
        return f"a figure below 0 ({SECOND_FIELDS[values.index(low)]} {low:g})"
    if s.steps > MAX_STEPS_A_SECOND:
        return f"{s.steps:.0f} steps in one second"
    for count in COUNTS:
        n = getattr(s, count)
        if n != int(n) or n > s.steps:
            return f"{count} {n:g} of {s.steps:g} steps"
    return None


# -- what a relay registers -----------------------------------------------------------------------
MAX_TEXT = 255  # a name, a host, an id
MAX_ADDRESS = 255


class RelayInfo(msgspec.Struct, omit_defaults=True):
    """One relay's entry: its registry file (monitor/relay/registry.py), a line of the job's store
    (monitor/link/store.py), its `hello` reply. No secret; a server key is its public half."""

    pid: int
    job_id: str
    node: str
    address: str  # ipc: requests
    pub_address: str  # ipc: summaries
    host: str = ""
    ssh_host: str = ""  # how a monitor reaches its node over ssh ("": host)
    start_time: float = 0.0
    version: str = ""
    kind: str = "relay"
    tcp_address: str | None = None  # CURVE only, when it listens on TCP
    tcp_pub_address: str | None = None
    server_key: str | None = None  # its CURVE public key (Z85): trusted only from a known source
    # reader side, never written: the ssh target whose listing gave it (learned over ssh)
    ssh: str | None = None

    def to_json(self) -> dict[str, Any]:
        """What is written and sent: no reader-side field."""
        out: dict[str, Any] = {"kind": self.kind, **msgspec.to_builtins(self)}  # said, default or not
        out.pop("ssh", None)
        return out

    @property
    def reach(self) -> str:
        """The ssh name of its node."""
        return self.ssh_host or self.host


_decode_info = msgspec.json.Decoder(RelayInfo)
_convert_errors = (msgspec.ValidationError, msgspec.DecodeError, ValueError, TypeError, RecursionError)


def relay_info(raw: Mapping[str, Any] | str | bytes) -> RelayInfo:
    """A relay entry from JSON (text, or an object already parsed), checked: ValueError saying
    what is wrong. A field it does not know is ignored (a newer relay's)."""
    try:
        if isinstance(raw, (str, bytes)):
            info = _decode_info.decode(raw)
        else:
            info = msgspec.convert(dict(raw), RelayInfo)
    except _convert_errors as exc:
        raise ValueError(f"not a relay entry ({str(exc)[:120]})") from None
    problem = _info_problem(info)
    if problem is not None:
        raise ValueError(problem)
    return info


def _info_problem(info: RelayInfo) -> str | None:
    if info.kind != "relay":
        return f"kind {info.kind[:40]!r}, not relay"
    if not 0 < info.pid <= PID_CEILING:  # another machine's pid: Linux's ceiling, not ours
        return f"pid {info.pid} out of range"
    texts = {"job_id": info.job_id, "node": info.node, "host": info.host, "ssh_host": info.ssh_host}
    texts["version"] = info.version
    for name, text in texts.items():
        if len(text) > MAX_TEXT or not text.isprintable():
            return f"{name} of {len(text)} characters, or not printable"
    if not info.node or not info.job_id:
        return "no node or no job id"
    if info.ssh_host.startswith("-") or info.host.startswith("-"):
        return "a host name starting with '-'"  # never an ssh option
    for name in ("address", "pub_address", "tcp_address", "tcp_pub_address"):
        a = getattr(info, name)
        if a is None:
            continue
        want = "tcp://" if name.startswith("tcp") else "ipc://"
        if len(a) > MAX_ADDRESS or not a.startswith(want) or not a.isprintable():
            return f"{name} not a {want} address of at most {MAX_ADDRESS} characters"
    if info.server_key is not None and (len(info.server_key) != 40 or not info.server_key.isascii()):
        return "a server key that is not 40 Z85 characters"
    if info.start_time < 0:
        return "a start time below 0"
    return None


def relay_line(info: RelayInfo) -> bytes:
    """The entry as one JSON line (the store's relays key)."""
    return (json.dumps(info.to_json(), separators=(",", ":")) + "\n").encode()
