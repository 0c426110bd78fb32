"""What says why, on the wire: the stack sampler's samples, sync detection's sites and the FLOP
count, gathered in `Why` (docs/why.md)."""

from __future__ import annotations

import msgspec

_NESTED = (
    ".<locals>.<genexpr>",
    ".<locals>.<listcomp>",
    ".<locals>.<dictcomp>",
    ".<locals>.<setcomp>",
    ".<locals>.<lambda>",
)


def function_of(qualname: str) -> str:
    """The function a comprehension or lambda belongs to: "f.<locals>.<genexpr>" -> "f" (how
    the monitor names a StackSample's function)."""
    while qualname.endswith(_NESTED):
        qualname = qualname.rsplit(".<locals>.", 1)[0]
    return qualname


class StackSample(msgspec.Struct, array_like=True):
    """The training thread's Python stack, sampled from an agent thread (agent/telemetry/stacks.py).

    `t` is the agent's perf_counter_ns (the log's clock); `phase` an index into logcodes.SAMPLE_PHASES
    (6: other, 7: checkpoint), read off torchtop's wrapper frames on the stack (or the log's open explicit phase).
    `site` is the innermost frame of the user's own code ("path:line function"; a library's when
    none), `callee` the function it was in the middle of calling ("module:qualname"; "" when the
    site is the innermost Python frame). `sync`: the innermost frame sat at a call that a sync
    window saw synchronise the device, and the sample was taken on time (not `late`), so the
    training thread was blocked there. `late`: the sample came over 1 ms after it was due (the
    training thread held the GIL, so its stack was read where it let go of it).
    `caller`: where the user's function at `site` was called from ("path:line function": the
    next frame of the user's own code outward, past that function's own comprehensions and
    lambdas; "" when none). `input`: the thread was resuming the loop's input generator from
    the `for` statement, or a `next()` call, of the loop that calls the model (a plain
    generator feeding the loop: data wait that no hook times).
    """

    t: int
    phase: int
    site: str = ""
    callee: str = ""
    sync: bool = False
    late: bool = False
    caller: str = ""
    input: bool = False


class SyncSite(msgspec.Struct, omit_defaults=True):
    """A place where the training thread synchronised the device, seen in a sync window."""

    site: str  # the user's frame, "path:line function"
    call: str = ""  # what synchronised, as called there (".item()", "print()"); "" unknown
    via: str = ""  # the torch function that synchronised on its behalf ("module:qualname")
    line: str = ""  # the source line
    calls: int = 0  # synchronisations seen there, over all windows
    steps: int = 0  # training steps those windows spanned


class SyncInfo(msgspec.Struct, omit_defaults=True):
    """Sync detection: short windows with torch.cuda.set_sync_debug_mode("warn") (docs/why.md)."""

    state: str  # "off" (reason says why) | "waiting" | "window" (one is open) | "idle" (between)
    reason: str = ""
    windows: int = 0  # windows run so far
    window_s: float = 0.0  # how long each lasts
    every_s: float = 0.0  # how often one opens while a monitor listens
    last_at: float | None = None  # unix time the last window closed
    cost_us: float | None = None  # training-thread time torchtop spent per synchronisation seen
    sites: list[SyncSite] = []


class FlopInfo(msgspec.Struct, omit_defaults=True):
    """The model's FLOPs per training step, counted once (FlopCounterMode over one step) or given."""

    state: str  # "waiting" | "counting" | "done" | "off" | "failed" (reason says why)
    reason: str = ""
    source: str = ""  # "counted" (FlopCounterMode) | "given" (TORCHTOP_FLOPS_PER_STEP)
    flops: int = 0  # per training step, every micro-batch's forward and backward
    by_dtype: dict[
        str, int
    ] = {}  # FLOPs by the dtype of the op's first input ("bfloat16", ...; "tf32": CUDA convs under cuDNN's TF32)
    tf32: bool = False  # float32 matmuls may use TF32 (torch.get_float32_matmul_precision() != "highest")
    samples: int | None = None  # per step: the roots' inputs' first dimension, over micro-batches
    tokens: int | None = None  # per step, when the input is a 2-D integer tensor (token ids)
    input_shape: list[int] = []
    input_dtype: str = ""
    t0: int = 0  # perf_counter_ns: the counted step began (it and the next are kept out of stats)
    t1: int = 0  # ... and the counter was taken down
    cost_ms: float | None = None  # how long the counted step took
    peak_tflops: float | None = None  # the user's peak (TORCHTOP_PEAK_TFLOPS), over the table's


class Why(msgspec.Struct, omit_defaults=True):
    """What says why: stack samples since the last batch, sync detection, the FLOP count."""

    stacks: list[StackSample] = []
    stack_hz: float = 0.0  # the sampler's rate (0: off)
    stack_cost_us: float | None = None  # the sampler's CPU per sample (mostly holding the GIL)
    sync: SyncInfo | None = None
    flops: FlopInfo | None = None
    # the parameters of the modules the loop calls (its roots: a pipeline stage's own module), each
    # counted once; None: no root seen yet (an older agent sends none)
    params: int | None = None
