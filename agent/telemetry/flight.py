"""Torch's flight recorder, read while the run is stalled: where each process group is in its
collectives (group, op, sequence number), for the monitor to name the rank that never arrived.

At agent start the recorder's buffer is set where the user set none (TORCH_FR_BUFFER_SIZE, the
older TORCH_NCCL_TRACE_BUFFER_SIZE): it takes effect for the process groups made after;
TORCHTOP_FLIGHT_RECORDER=0 leaves the environment alone and never reads it. The dump is torch's
own call (`_dump_fr_trace_json`, older torch's NCCL-only `_dump_nccl_trace_json`), never a signal;
it runs on the agent thread, only when no step ended for STALL_MIN_S and STALL_STEPS median steps,
at most every READ_EVERY_S. A torch without the call, or a dump that fails: nothing sent, said once.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import deque
from collections.abc import Callable, MutableMapping
from typing import Any

from torchtop.agent.warn import notice
from torchtop.contract.telemetry import MAX_COLLECTIVE_GROUPS, MAX_COLLECTIVE_TEXT, Collective

ENV = "TORCH_FR_BUFFER_SIZE"
OLD_ENV = "TORCH_NCCL_TRACE_BUFFER_SIZE"
OPT_OUT = "TORCHTOP_FLIGHT_RECORDER"
BUFFER = 2000  # entries torch keeps (its default in recent releases): a few hundred KiB
STALL_MIN_S = 3.0  # read before the monitor's stall limit (5 s, 5 median steps) says stalled
STALL_STEPS = 3.0
READ_EVERY_S = 2.0
PACE_STEPS = 50  # the pace: the median of this many recent step intervals
MIN_PACE = 3  # fewer intervals seen: no pace to stall from
DUMPS = ("_dump_fr_trace_json", "_dump_nccl_trace_json")
COMPLETED = "completed"
Dump = Callable[[], Any]


def enable(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Whether the flight recorder is read at all; sets its buffer where the user set none."""
    if environ.get(OPT_OUT, "").strip() == "0":
        return False
    if ENV not in environ and OLD_ENV not in environ:
        environ[ENV] = str(BUFFER)
    return True


def _clip(text: object) -> str:
    return str(text)[:MAX_COLLECTIVE_TEXT]


def _op(name: object) -> str:
    """ "gloo:all_reduce" / "nccl:all_reduce" -> "all_reduce"."""
    text = str(name)
    return _clip(text.split(":", 1)[1] if ":" in text else text)


def _group(entry: dict[str, Any]) -> tuple[str, str]:
    """(the group's id, its name): the name its maker gave (group_desc), else "pg ID"."""
    pg = entry.get("process_group")
    gid = str(entry.get("pg_id", ""))
    name = ""
    if isinstance(pg, (list, tuple)) and len(pg) >= 2:  # pyright: ignore[reportUnknownArgumentType]
        gid = str(pg[0])  # pyright: ignore[reportUnknownArgumentType]
        name = str(pg[1])  # pyright: ignore[reportUnknownArgumentType]
    if not name or name == "undefined":
        name = f"pg {gid}"
    return gid, _clip(name)


def reduce_dump(dump: dict[str, Any], now_ns: int) -> list[Collective]:
    """Each process group's place: its last collective (highest sequence number) and, where the
    states are real (NCCL's; gloo's stay "scheduled" when done), the oldest one not completed."""
    entries = dump.get("entries")
    if not isinstance(entries, list):
        return []
    by_group: dict[str, tuple[str, list[dict[str, Any]]]] = {}
    for e in entries:  # pyright: ignore[reportUnknownVariableType]
        if not isinstance(e, dict) or e.get("is_p2p"):  # p2p pairs have their own numbers
            continue
        seq = e.get("collective_seq_id")  # pyright: ignore[reportUnknownMemberType]
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            continue
        gid, name = _group(e)  # pyright: ignore[reportUnknownArgumentType]
        by_group.setdefault(gid, (name, []))[1].append(e)  # pyright: ignore[reportUnknownArgumentType]
    out: list[Collective] = []
    for gid, (name, es) in by_group.items():
        es.sort(key=lambda e: e["collective_seq_id"])
        last = es[-1]
        known = not str(last.get("profiling_name", "")).startswith("gloo:")
        named = last
        if known:
            pending = [e for e in es if e.get("state") != COMPLETED]
            named = pending[0] if pending else last
        created = named.get("time_created_ns")
        age = (now_ns - created) / 1e9 if isinstance(created, int) and 0 < created <= now_ns else 0.0
        out.append(
            Collective(
                group=name,
                group_id=_clip(gid),
                op=_op(named.get("profiling_name", "")),
                seq=named["collective_seq_id"],
                last_seq=last["collective_seq_id"],
                state=_clip(named.get("state", "")) if known else "",
                age_s=round(min(age, 1e9), 3),
            )
        )
    out.sort(key=lambda c: c.age_s, reverse=True)  # the longest waits first, the rest dropped
    return out[:MAX_COLLECTIVE_GROUPS]


def torch_dump() -> Dump | None:
    """torch's dump call, where torch.distributed is in use; None otherwise."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    c10d = sys.modules.get("torch._C._distributed_c10d")
    found = [fn for fn in (getattr(c10d, name, None) for name in DUMPS) if fn is not None]
    if not found:
        return None
    if len(found) == 1:
        return lambda: found[0](True, False)  # includeCollectives, not only the active ones
    return lambda: _merged(found)


def _merged(dumps: list[Callable[..., Any]]) -> bytes:
    """Every recorder's entries in one dump: a torch with both keeps NCCL's collectives in the
    NCCL recorder and the others' (gloo's) in the generic one."""
    entries: list[Any] = []
    for fn in dumps:
        try:
            got = json.loads(fn(True, False))
        except Exception:  # broad: one recorder that cannot say; the other may
            continue
        if isinstance(got, dict) and isinstance(got.get("entries"), list):
            entries += got["entries"]  # pyright: ignore[reportUnknownArgumentType]
    return json.dumps({"entries": entries}).encode()


class FlightReader:
    """On the agent thread: `poll(steps)` each telemetry tick; `groups` what the last read found
    while stalled ([] otherwise)."""

    def __init__(self, dump: Callable[[], Dump | None] = torch_dump) -> None:
        self._find = dump
        self.groups: list[Collective] = []
        self.failed = ""  # why it stopped reading (said once)
        self.reads = 0
        self._steps = -1
        self._changed = 0.0  # monotonic time the step count last changed
        self._paces: deque[float] = deque(maxlen=PACE_STEPS)
        self._due = 0.0

    def stalled_for(self, now: float) -> float | None:
        """Seconds without a step end when that is a stall at the run's pace, else None."""
        if len(self._paces) < MIN_PACE:
            return None
        paces = sorted(self._paces)
        silent = now - self._changed
        limit = max(STALL_MIN_S, STALL_STEPS * paces[len(paces) // 2])
        return silent if silent >= limit else None

    def poll(self, steps: int | None, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if steps is None:
            return
        if steps != self._steps:
            if self._steps >= 0 and steps > self._steps:
                self._paces.append((now - self._changed) / (steps - self._steps))
            self._steps, self._changed = steps, now
            self.groups = []
            return
        if self.failed or self.stalled_for(now) is None or now < self._due:
            return
        self._due = now + READ_EVERY_S
        self.groups = self.read()

    def read(self) -> list[Collective]:
        try:
            dump = self._find()
            if dump is None:
                return []
            raw = dump()
            got = json.loads(raw)
            if not isinstance(got, dict):
                raise ValueError(f"a dump of {type(got).__name__}")  # pyright: ignore[reportUnknownArgumentType]
            self.reads += 1
            return reduce_dump(got, time.time_ns())  # pyright: ignore[reportUnknownArgumentType]
        except Exception as exc:  # broad: torch's dump may raise anything; never into the run
            self.failed = f"{type(exc).__name__}: {exc}"[:200]
            notice(f"torch's flight recorder could not be read ({self.failed}); hangs are named without it")
            return []
