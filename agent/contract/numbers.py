"""The one check of a decoded message's numbers: finite, and within what any figure can be.

wire.decode calls it on every frame, live (the monitor's client, the agent's request router)
and from recordings, so a NaN, an infinity or a float of 1e300 is refused once, at the door,
and never reaches a step count, a rate or a trace (where it would raise: int(nan), round(inf)).
msgpack's own integers stop at 64 bits, so only floats need a bound: FLOAT_LIMIT is far beyond
any figure torchtop sends (unix seconds ~2e9, bytes as ints, ms, percents, watts) and far below
where a product of two of them overflows.

Exceptions: a user's mark (torchtop.agent.mark("loss", x)) carries the user's own number, and a
NaN loss is news, not damage: it passes (the monitor shows "nan"); a capture's summary is
free-form text figures, shown and never computed with.
Imports only msgspec and the standard library.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import msgspec
import msgspec.inspect as mi

from torchtop.contract.logcodes import MARK, MASK

FLOAT_LIMIT = 1e15
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 63) - 1
COUNT_MAX = 1 << 53  # a log chunk's seq and step count: a step a nanosecond for 100 days is less
# the builtin, typed: type(x) of an Any is type[Unknown] to pyright, and a cast() costs a call a number
_type: Callable[[object], type[Any]] = type


def _bad_float(x: float) -> bool:
    return not (-FLOAT_LIMIT <= x <= FLOAT_LIMIT)  # NaN fails every comparison


def _may_hold_float(t: mi.Type) -> bool:
    """Whether a value of the declared type can hold a float anywhere inside."""
    if isinstance(t, (mi.FloatType, mi.IntType, mi.AnyType)):
        return True
    if isinstance(t, (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)):
        return _may_hold_float(t.item_type)
    if isinstance(t, mi.TupleType):
        return any(_may_hold_float(x) for x in t.item_types)
    if isinstance(t, mi.DictType):
        return _may_hold_float(t.key_type) or _may_hold_float(t.value_type)
    if isinstance(t, mi.UnionType):
        return any(_may_hold_float(x) for x in t.types)
    if isinstance(t, mi.StructType):
        return bool(_fields(t.cls))
    return False


def _fields(cls: type) -> tuple[str, ...]:
    """The fields of a Struct class that can hold a float: the only ones checked."""
    found = _FIELDS.get(cls)
    if found is None:
        info = mi.type_info(cls)
        assert isinstance(info, mi.StructType)
        found = tuple(
            f.name
            for f in info.fields
            if _may_hold_float(f.type) and (cls.__name__, f.name) not in _FREE_FORM
        )
        _FIELDS[cls] = found
    return found


_FIELDS: dict[type, tuple[str, ...]] = {}


#: Free-form figures shown as text, not computed with: a NaN there (a profiler's 0/0) must not
#: cost every batch that carries the capture.
_FREE_FORM = {("CaptureInfo", "summary")}


def _is_log(cls: type[msgspec.Struct]) -> bool:
    """A LogChunk (wire.py imports this module, so it is known by its fields)."""
    fields = cls.__struct_fields__
    return fields[-2:] == ("entries", "pairs")


def bad_number(obj: Any) -> str | None:
    """Where in `obj` (a decoded message) a number is non-finite or out of range, with its
    value ("Batch.telemetry.time = nan"); None when every number is in range."""
    found = _check(obj)
    if found is None:
        return None
    value, *path = found  # innermost part first
    return type(obj).__name__ + "".join(reversed(path)) + f" = {value!r}"


def _check(obj: Any) -> list[Any] | None:
    """None, or [value, innermost part, ..., outermost part] of the first bad number."""
    kind = _type(obj)
    if kind is float:
        return [obj] if _bad_float(obj) else None
    if kind is int:  # msgpack carries up to 2**64 - 1: readers take int64 (an index's array('q'))
        return None if _INT_MIN <= obj <= _INT_MAX else [obj]
    if kind in (str, bool, bytes) or obj is None:
        return None
    if isinstance(obj, msgspec.Struct):
        if _is_log(kind):
            return _bad_chunk(obj)
        for name in _fields(kind):
            bad = _check(getattr(obj, name))
            if bad is not None:
                return _tail(bad, f".{name}")
        return None
    if isinstance(obj, (list, tuple)):
        seq = cast("Sequence[Any]", obj)  # an isinstance leaves list[Unknown]
        kinds = set(map(type, seq))
        if kinds <= _PLAIN and (int not in kinds or (kinds == _INTS and _ints_in_range(seq))):
            return None  # the usual case, at C speed (a mix of ints and text: item by item)
        if kinds <= _NUMBERS and _all_in_range(seq):  # figures (per-core CPU): at C speed too
            return None
        for k, item in enumerate(seq):
            bad = _check(item)
            if bad is not None:
                return _tail(bad, f"[{k}]")
        return None
    if isinstance(obj, dict):
        for key, value in cast("dict[Any, Any]", obj).items():
            bad = _check(value)
            if bad is not None:
                return _tail(bad, f"[{str(key)[:40]!r}]")
        return None
    if isinstance(obj, float):  # a float subclass (an Enum never is one)
        return _check(float(obj))
    return None


_PLAIN = {int, str, bool}
_INTS = {int}
_NUMBERS = {int, float, bool}


def _ints_in_range(xs: Sequence[int]) -> bool:
    return _INT_MIN <= min(xs) and max(xs) <= _INT_MAX


def _all_in_range(xs: Sequence[float]) -> bool:
    """NaN and inf make the sum of magnitudes NaN or inf; a huge one shows in the largest."""
    total = sum(map(abs, xs))
    return total == total and total <= FLOAT_LIMIT * len(xs) and max(map(abs, xs)) <= FLOAT_LIMIT


def _tail(found: list[Any] | None, part: str) -> list[Any] | None:
    if found is not None:
        found.append(part)
    return found


def _bad_chunk(chunk: Any) -> list[Any] | None:
    """A LogChunk: its seq and step count (0..COUNT_MAX: replays index arrays of int64 by them),
    then its entries."""
    for name in ("seq", "steps"):
        value = getattr(chunk, name)
        if type(value) is not int or not 0 <= value <= COUNT_MAX:
            return [value, f".{name}"]
    return _tail(_bad_entries(chunk.entries), ".entries")


def _bad_entries(entries: list[Any]) -> list[Any] | None:
    """A log's entries: ints (at C speed) within int64, and tuples whose numbers are checked,
    except a mark's value (its third item)."""
    try:  # msgspec made each an int or a tuple; ints alone sum at C speed, a tuple stops it
        sum(entries)
    except TypeError:
        pass
    else:
        if not entries or _ints_in_range(entries):
            return None
    for k, e in enumerate(entries):
        if type(e) is int:
            if not _INT_MIN <= e <= _INT_MAX:
                return [e, f"[{k}]"]
            continue
        if isinstance(e, (tuple, list)):
            t = cast("Sequence[Any]", e)  # an isinstance leaves list[Unknown]
            if t and type(t[0]) is int and len(t) == 3 and (t[0] == MARK or t[0] & MASK == MARK):
                e = t[:2]  # the user's value is theirs, NaN included
        bad = _check(e)
        if bad is not None:
            return _tail(bad, f"[{k}]")
    return None
