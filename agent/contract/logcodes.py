"""The training thread's log: its phases, its codes and how entries are packed.

The contract's second half beside the messages (wire.py): the agent ships the log as the training
thread wrote it (`wire.LogChunk`) and the monitor replays it into steps
(monitor/model/replay.py). An entry is `perf_counter_ns() << SHIFT | code`, or a tuple whose first
item is that int: (stamp, device ms) on a step with CUDA events, the device time being from the
step's STEP_EVENT (None when unknown); (stamp, device ms, record ns) for BOUNDARY and STEP_END;
(stamp, host ns, bytes, pinned, device ms) for H2D_COPY; (stamp, name, value) for MARK;
(stamp, samples, tokens, sequence) for WORK; (stamp, name) for COMM_GROUP. The
training thread writes each entry as two items, a time and a code (agent/hooks/probe.py);
`to_entries` packs them. Imports only the standard library.

`comm` is the exposed collective wait: time in blocking collectives called on the training thread
(agent/hooks/collectives.py), and the end of a backward pass from COMM_READY (its compute done:
logged by an autograd final callback queued before DDP's or FSDP's own) to its return, where
DDP waits for its all-reduce (docs/multi-rank.md).
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import repeat
from operator import lshift as _lshift  # pyright: ignore[reportUnknownVariableType]
from operator import or_ as _or  # pyright: ignore[reportUnknownVariableType]
from typing import Any, Union, cast

#: One item of the training thread's log (a time or a code), or one packed entry: an int, or a
#: tuple headed by one.
Item = Union[int, tuple[Any, ...]]
_LSHIFT = cast(Callable[[Any, int], int], _lshift)  # pairs of plain ints at C speed (to_entries)
_OR = cast(Callable[[int, Any], int], _or)
#: Phases measured on the training thread, in display order. `other` is the rest of the step.
PHASES: tuple[str, ...] = ("data", "h2d", "forward", "backward", "optimizer", "comm", "checkpoint", "other")
TIMED_PHASES: tuple[str, ...] = PHASES[:-1]
DATA, H2D, FORWARD, BACKWARD, OPTIMIZER, COMM, CHECKPOINT = range(7)  # indices into TIMED_PHASES
#: A stack sample's phase index (why.StackSample.phase), append-only: `other` kept 6, as recorded before
#: `checkpoint` was a phase
SAMPLE_PHASES: tuple[str, ...] = (*TIMED_PHASES[:CHECKPOINT], "other", "checkpoint")
SAMPLE_OTHER, SAMPLE_CHECKPOINT = 6, 7

SHIFT = 8
MASK = (1 << SHIFT) - 1
EXIT = 8  # code: phase (0..4) opens it, EXIT | phase closes it
GRAD = 6  # opens BACKWARD for torch.autograd.grad: backward time, but not a micro-batch
SAVE = 7  # opens CHECKPOINT (a save: hooks/checkpoint.py); EXIT | SAVE closes it (a code, not its index)
BACKWARD_STEPS = 18  # no optimizer.step() seen: from here each backward's end ends a step (BOUNDARY)
COMM_GROUP = 19  # (stamp, group name): the collective just entered runs on this process group (dp, tp...)
#: COMM_GROUP's name for a pipeline schedule's send/recv wait (the bubble), whatever its group's name
PIPELINE = "pipeline"
OPEN_STEP = 20  # `with step():` entered: explicit boundaries from now on
BOUNDARY = 21  # a training step ends here
SKIPPED = 22  # GradScaler skipped an optimizer step (inf/NaN gradients)
STEP_EVENT = 23  # an event step (CUDA events recorded) starts here
H2D_COPY = 24  # one host-to-device copy
MARK = 25  # a user scalar
RESET = 26  # entries were lost before this one: forget the open step
STEP_END = 27  # the optimizer phase closes and a training step ends here (EXIT | OPTIMIZER, BOUNDARY)
UNTIMED_END = 28  # a training step ends here; its phases were not timed (phase sampling: probe.py)
TIMING_RESUMED = 29  # phases are timed from here: the open step's earlier phases were not
COMM_READY = 30  # the open backward's compute is done: the rest of it is collective wait (comm)
WORK = 31  # (stamp, samples, tokens, sequence): a timed root forward's batch shape (hooks/work.py)
STEP_ENDS = (BOUNDARY, STEP_END, UNTIMED_END)
FORWARD_START = 32  # FORWARD_START + 2 * root slot + grad: a root module's forward begins
MAX_SLOT = (MASK - FORWARD_START) // 2  # root slots 0..MAX_SLOT; slot 0 is phase("forward")


def code_of(entry: Item) -> int:
    # type() is, not isinstance: half the cost, on every entry a monitor replays (no bool is logged)
    return (entry if type(entry) is int else entry[0]) & MASK  # pyright: ignore[reportIndexIssue, reportUnknownVariableType]


def opens_step(code: int) -> bool:
    """A code whose entry opens a step when none is open, as the monitor's replay reads it: a
    phase entered, a root forward, `with step():`, a step end. A copy, a mark or a group name
    is not a step's start (a model's `.to("cuda")` before the loop logs copies)."""
    return code <= SAVE or code >= FORWARD_START or code == OPEN_STEP or code in STEP_ENDS


def is_step_end(entry: Item) -> bool:
    return code_of(entry) in STEP_ENDS


def count_step_ends(codes: list[Item]) -> int:
    """Step ends among a log's code items (small ints; a tuple code is never counted here)."""
    return codes.count(STEP_END) + codes.count(BOUNDARY) + codes.count(UNTIMED_END)


CONVERT_BLOCK = 512  # items (256 pairs) converted at a time: a tuple costs Python speed to its block only


def to_entries(raw: list[Item]) -> tuple[list[Item], int]:
    """The training thread's log pairs (agent/hooks/probe.py) as entries (`ns << SHIFT | code`, or a
    tuple headed by one), and the step ends among them. The monitor does this for a CPU run's
    chunks (not the agent thread's business: it shares the GIL with training); the agent, before it resolves CUDA
    events. Pairs of plain ints convert at C speed, block by block: on CUDA nearly every tick's
    log holds an event step's tuples, which used to send the whole tick's log down the Python
    path (~0.3 ms of GIL a tick on an H200). Malformed pairs raise."""
    if len(raw) <= CONVERT_BLOCK:
        return _block_entries(raw)
    out: list[Item] = []
    cuts = 0
    for i in range(0, len(raw), CONVERT_BLOCK):
        entries, n = _block_entries(raw[i : i + CONVERT_BLOCK])
        out += entries
        cuts += n
    return out, cuts


def _block_entries(raw: list[Item]) -> tuple[list[Item], int]:
    times, codes = raw[0::2], raw[1::2]
    try:
        entries: list[Item] = list(map(_OR, map(_LSHIFT, times, repeat(SHIFT)), codes))
        return entries, count_step_ends(codes)
    except TypeError:
        pass
    out: list[Item] = []
    cuts = 0
    extra: tuple[Any, ...]
    for t, c in zip(times, codes):  # type() is, not isinstance: per entry, on the agent thread
        if type(c) is int:
            code, extra = c, ()
        else:
            ct: tuple[Any, ...] = c  # pyright: ignore[reportAssignmentType]
            code, extra = ct[0], ct[1:]
        cuts += code in STEP_ENDS
        if type(t) is int:
            head = t << SHIFT | code
        else:
            tt: tuple[Any, ...] = t  # pyright: ignore[reportAssignmentType]
            head = tt[0] << SHIFT | code
            extra = (*tt[1:], *extra)
        out.append((head, *extra) if extra else head)
    return out, cuts


def last_step(entries: list[Any]) -> list[Any] | None:
    """A chunk thinned for the sparse history: RESET, then its entries from its second-to-last
    step boundary on (one whole step, and the start of the next, which the following chunk
    continues). None when the chunk does not hold a whole training step."""
    end = None
    for k in range(len(entries) - 1, -1, -1):
        if is_step_end(entries[k]):
            if end is not None:
                return [RESET, *entries[k:]]
            end = k
    return None


def last_step_pairs(items: list[Any]) -> list[Any] | None:
    """`last_step` for a chunk of (time, code) pairs."""
    end = None
    for k in range(len(items) - 1, 0, -2):
        if code_of(items[k]) in STEP_ENDS:
            if end is not None:
                return [0, RESET, *items[k - 1 :]]
            end = k
    return None
