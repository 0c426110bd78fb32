"""The one check of a decoded message's numbers: finite, and within what any figure can be.

wire.decode calls it on every frame, live (the monitor's client, the agent's request router)
and from recordings, so a NaN, an infinity or a float of 1e300 is refused once, at the door,
and never reaches a step count, a rate or a trace (where it would raise: int(nan), round(inf)).
msgpack's own integers stop at 64 bits, so only floats need a bound: FLOAT_LIMIT is far beyond
any figure torchtop sends (unix seconds ~2e9, bytes as ints, ms, percents, watts) and far below
where a product of two of them overflows.

One exception: a user's mark (torchtop.agent.mark("loss", x)) carries the user's own number,
and a NaN loss is news, not damage: it passes (the monitor shows "nan").
Imports only msgspec and the standard library.
"""

from __future__ import annotations

from typing import Any

import msgspec

from torchtop.agent.contract.logcodes import MARK, MASK

FLOAT_LIMIT = 1e15


def _bad_float(x: float) -> bool:
    return not (-FLOAT_LIMIT <= x <= FLOAT_LIMIT)  # NaN fails every comparison


def bad_number(obj: Any, where: str = "") -> str | None:
    """Where in `obj` (a decoded message) a number is non-finite or out of range, with its
    value ("Batch.telemetry.time = nan"); None when every number is in range."""
    kind = type(obj)
    if kind is float:
        return f"{where} = {obj!r}" if _bad_float(obj) else None
    if kind in (int, str, bool, bytes) or obj is None:
        return None
    if isinstance(obj, msgspec.Struct):
        fields = kind.__struct_fields__
        if fields and fields[-1] == "pairs" and "entries" in fields:  # a LogChunk
            return _bad_entries(obj.entries, f"{where}.entries")  # type: ignore[attr-defined]
        for name in fields:
            bad = bad_number(getattr(obj, name), f"{where}.{name}" if where else f"{kind.__name__}.{name}")
            if bad is not None:
                return bad
        return None
    if isinstance(obj, (list, tuple)):
        if set(map(type, obj)) <= {int, str, bool}:  # the usual case, at C speed
            return None
        for k, item in enumerate(obj):
            bad = bad_number(item, f"{where}[{k}]")
            if bad is not None:
                return bad
        return None
    if isinstance(obj, dict):
        for key, value in obj.items():
            bad = bad_number(value, f"{where}[{key!r}]"[:200])
            if bad is not None:
                return bad
        return None
    if isinstance(obj, float):  # a float subclass (an Enum never is one)
        return bad_number(float(obj), where)
    return None


def _bad_entries(entries: list[Any], where: str) -> str | None:
    """A log's entries: ints (at C speed), and tuples whose numbers are checked, except a
    mark's value (its third item)."""
    if set(map(type, entries)) <= {int}:
        return None
    for k, e in enumerate(entries):
        if type(e) is int:
            continue
        if not isinstance(e, (tuple, list)):
            bad = bad_number(e, f"{where}[{k}]")
        elif e and type(e[0]) is int and (e[0] == MARK or e[0] & MASK == MARK) and len(e) == 3:
            bad = bad_number(e[:2], f"{where}[{k}]")  # the user's value is theirs, NaN included
        else:
            bad = bad_number(e, f"{where}[{k}]")
        if bad is not None:
            return bad
    return None
