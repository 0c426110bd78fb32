"""Reading a recording of an older wire protocol: its messages upgraded to this one's.

A recording names its wire protocol in its header (recording.py); this torchtop reads this
protocol and the one before it (READ_PROTOCOLS). A message of the one before decodes with this
protocol's structs (fields added since take their defaults, fields gone are ignored); what
changed meaning is mapped here, one function per protocol. When the protocol moves on, the
oldest upgrade goes and the new previous one comes: docs/recording.md says how.

Protocol 4 -> 5: the log's GRAD code was 5 (5 is now COMM, the collective wait, and GRAD 6);
the hello's `cuda_sample_every` is `cuda_event_every`. Imports only msgspec and the stdlib.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, cast

import msgspec

from torchtop.contract import logcodes, wire

Decode = Callable[[bytes], wire.Message]

_V4_GRAD = 5


class _HelloV4(msgspec.Struct):
    cuda_sample_every: int = 0


_hello_v4 = msgspec.msgpack.Decoder(_HelloV4)


def _code_v4(item: Any, packed: bool) -> Any:
    """One log item of protocol 4 in protocol 5's codes (a packed entry, or a pair's code)."""
    raw: object = item  # narrowed on its own: `item` stays Any (an isinstance on it is list[Unknown])
    seq = cast("Sequence[object]", raw) if isinstance(raw, (tuple, list)) else ()
    head: object = item if type(item) is int else (seq[0] if seq else None)
    if type(head) is not int:
        return item
    code = head & logcodes.MASK if packed else head
    if code != _V4_GRAD:
        return item
    new = head + (logcodes.GRAD - _V4_GRAD)
    return new if type(item) is int else (new, *seq[1:])


def upgrade_v4(msg: wire.Message, payload: bytes) -> wire.Message:
    if isinstance(msg, wire.Hello):
        msg.v = wire.PROTOCOL_VERSION
        if not msg.cuda_event_every:
            msg.cuda_event_every = _hello_v4.decode(payload).cuda_sample_every
        return msg
    if isinstance(msg, wire.Batch):
        msg.v = wire.PROTOCOL_VERSION
        for chunk in msg.log:
            entries = chunk.entries
            if chunk.pairs:  # (time, code) items: the codes are the odd ones
                entries[1::2] = [_code_v4(c, False) for c in entries[1::2]]
            else:
                chunk.entries = [_code_v4(e, True) for e in entries]
    return msg


def _decode_old(
    upgrade: Callable[[wire.Message, bytes], wire.Message], version: int, payload: bytes
) -> wire.Message:
    return upgrade(wire.decode(payload, versions=(version,)), payload)


UPGRADES: dict[int, Callable[[wire.Message, bytes], wire.Message]] = {4: upgrade_v4}


def decoder_for(protocol: int) -> Decode:
    """How to decode a payload of a recording of `protocol` into this protocol's messages."""
    if protocol == wire.PROTOCOL_VERSION:
        return wire.decode
    upgrade = UPGRADES.get(protocol)
    if upgrade is None:
        raise ValueError(f"no upgrade from wire protocol {protocol}")
    return partial(_decode_old, upgrade, protocol)
