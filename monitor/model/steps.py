"""One replayed step, as the monitor keeps it: never sent, made here from the agent's log."""

from __future__ import annotations

from typing import Literal

import msgspec

StepKind = Literal["train", "eval"]


class StepRecord(msgspec.Struct, omit_defaults=True, gc=False):
    """One training (or eval) step as the training thread saw it.

    `phases` holds host nanoseconds per phase, `other` included, so they add up to `wall_ns`;
    it is empty on a step whose phases were not timed (phase sampling on fast steps).
    `device_ms` holds CUDA-event times of the phases that were sampled on this step (empty when
    the step was not sampled or the run is on CPU); `step` there is the stream time between
    this step's boundary events.
    """

    i: int
    t0: float  # wall clock (unix seconds) at step start
    wall_ns: int
    phases: dict[str, int]
    kind: StepKind = "train"
    micro: int = 1  # backward passes in the step (gradient accumulation micro-batches)
    device_ms: dict[str, float] = {}
    rank: int = 0
    skipped: int = 0  # optimizer steps GradScaler skipped (inf/NaN gradients) in this step
    h2d_bytes: dict[str, int] = {}  # bytes copied host-to-device from "pinned" / "pageable" memory
    marks: dict[str, float] = {}  # user scalars from torchtop.agent.mark()
    # the batch its root forwards were called with (agent/hooks/work.py; 0: not seen)
    samples: int = 0
    tokens: int = 0
    seq: int = 0  # the longest sequence
    comm_groups: dict[str, int] = {}  # host ns of the named collectives, by process group (dp, tp, pp...)
    device_groups: dict[str, float] = {}  # an event step's device ms of the same, by process group
    at_backward: bool = False  # ended at a backward's end: no optimizer.step() was seen (replay.py)
    # saves begun in this step and their host ns (agent/hooks/checkpoint.py): on every step, timed or not
    saves: int = 0
    saved_ns: int = 0
