"""What a frame's instruction calls, read off its code object's bytecode (once per code object:
the stack sampler caches the result): the loop's `for` and `next()` (its input), and a call's
dotted name (a frame blocked in a C function has no frame of its own to name it)."""

from __future__ import annotations

import dis
from types import CodeType

FOR_ITER = dis.opmap["FOR_ITER"]


# the instructions that make a call (3.10's, 3.11's and 3.12+'s names)
CALLS = frozenset(("CALL", "CALL_KW", "CALL_FUNCTION", "CALL_METHOD", "CALL_FUNCTION_KW", "CALL_FUNCTION_EX"))
NEXT_NAMES = frozenset(("next", "__next__"))  # `next(src)`, `src.__next__()`: a batch pulled by hand


def input_offsets(code: CodeType) -> frozenset[int]:
    """Offsets (frame.f_lasti's unit) in `code` where the loop takes its next input: its `for`
    statements' FOR_ITER instructions and its `next(...)` / `.__next__()` calls' call instructions
    (found by the stack depth: the first call after the name's load that leaves at most its result)."""
    out: set[int] = set()
    ins = list(dis.get_instructions(code))
    for k, i in enumerate(ins):
        if i.opcode == FOR_ITER:
            out.add(i.offset)
        elif i.argval in NEXT_NAMES and i.opname.startswith("LOAD_") and i.opname != "LOAD_CONST":
            depth, prev = 0, i
            for j in ins[k : k + 64]:  # a call's arguments, bounded
                try:
                    depth += dis.stack_effect(j.opcode, j.arg if j.opcode >= dis.HAVE_ARGUMENT else None)
                except ValueError:
                    break
                if j.opname in CALLS and depth <= 1:
                    out.add(j.offset)
                    if prev.opname == "PRECALL":  # 3.11's PRECALL, specialised for a builtin, calls it
                        out.add(prev.offset)
                    break
                prev = j
                if depth < 1:  # the name was stored or passed on, not called
                    break
    return frozenset(out)


NAME_LOADS = frozenset(("LOAD_GLOBAL", "LOAD_NAME", "LOAD_FAST", "LOAD_DEREF", "LOAD_CLOSURE"))
ATTR_LOADS = frozenset(("LOAD_ATTR", "LOAD_METHOD"))


def call_names(code: CodeType) -> dict[int, str]:
    """Offsets (frame.f_lasti's unit) of `code`'s calls whose callable is a name or a dotted
    name ("time.sleep", "self.conn.recv"), and that name: what a frame blocked in a C function
    (no Python frame of its own) is calling. Found as input_offsets finds `next()`: the first
    call after the name's load that leaves only its result."""
    out: dict[int, str] = {}
    ins = list(dis.get_instructions(code))
    for k, i in enumerate(ins):
        if i.opname not in NAME_LOADS or not isinstance(i.argval, str):
            continue
        names, chain, depth, prev = [i.argval], True, 0, i
        for j in ins[k : k + 64]:  # a call's arguments, bounded
            try:
                depth += dis.stack_effect(j.opcode, j.arg if j.opcode >= dis.HAVE_ARGUMENT else None)
            except ValueError:
                break
            if j is not i:
                if chain and j.opname in ATTR_LOADS and isinstance(j.argval, str):
                    names.append(j.argval)
                else:
                    chain = False
            if j.opname in CALLS and depth == 1:
                out.setdefault(j.offset, ".".join(names))
                if prev.opname == "PRECALL":  # 3.11: a builtin is called from its PRECALL
                    out.setdefault(prev.offset, ".".join(names))
                break
            prev = j
            if depth < 1:  # the name was stored or passed on, not called
                break
    return out
