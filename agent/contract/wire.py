"""The messages between agent and monitor.

msgspec Structs encoded as msgpack, one tagged union (`Message`), a protocol version in every
frame. Nothing is ever pickled; every frame is validated on decode. The log the messages carry
is described in logcodes.py.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Union

import msgspec

from torchtop.contract.numbers import FLOAT_LIMIT, bad_number

PROTOCOL_VERSION = 5
MAX_FRAME_BYTES = 16 * 1024 * 1024
#: A monitor subscribes to this topic beside everything (b""): someone watches, so the agent's
#: why probes (stack samples, sync windows) and its watched tick rate run. A node's relay
#: subscribes to everything alone: the stream flows at the quiet rate and the probes rest, unless
#: a monitor drills into the rank through the relay. No message starts with it (a msgpack
#: struct starts with a map or array header; 0xfe is a negative fixint).
WATCH_TOPIC = b"\xfewatch"
#: The most steps a `snapshot` request may ask for.
SNAPSHOT_MAX_STEPS = 16_000

# What a capture request may ask for: the agent refuses more, the TUI's keys and the CLI offer this.
CAPTURE_DEFAULT_STEPS = 5
PROFILE_MAX_STEPS = 100  # a profiler trace grows with every step it holds
MEMORY_MAX_STEPS = 1000
MEMORY_SECONDS = (0.1, 120.0)  # a memory capture by time: at least, at most


class WireError(ValueError):
    """A frame that is not a valid torchtop message of this protocol version."""


class _Name(str, Enum):
    """A state named by its string on the wire (and in JSON); compares equal to that string."""

    def __str__(self) -> str:
        return str(self.value)


class CaptureKind(_Name):
    PROFILE = "profile"  # a torch.profiler trace of N steps
    MEMORY = "memory"  # a CUDA memory snapshot after N steps or S seconds of allocator history


class CaptureState(_Name):
    PENDING = "pending"  # armed: waits for the training thread's next step boundary
    RUNNING = "running"
    WRITING = "writing"  # the files are written off the training thread
    DONE = "done"
    FAILED = "failed"


# tuples, not sets: a member's hash is its name's, so only equality matches a plain string
CAPTURE_ACTIVE = (CaptureState.PENDING, CaptureState.RUNNING, CaptureState.WRITING)
CAPTURE_FINISHED = (CaptureState.DONE, CaptureState.FAILED)


class MemorySample(msgspec.Struct, omit_defaults=True):
    """CUDA caching-allocator figures of one device (bytes), from memory_stats() at ~10 Hz."""

    device: int
    allocated: int
    reserved: int
    active: int
    requested: int  # what tensors asked for; allocated - requested is rounding waste
    inactive_split: int  # free inside split blocks: cached but not releasable
    peak_allocated: int  # since start (or the user's last reset_peak_memory_stats)
    peak_reserved: int
    window_peak: int  # highest allocated seen since the previous sample
    alloc_retries: int  # cudaMalloc failed, cache flushed, retried: a slowdown
    ooms: int
    # what this process may use: the device's memory from mem_get_info, or the share of it that
    # torch.cuda.set_per_process_memory_fraction allows (then limit_fraction < 1)
    device_total: int = 0
    device_free: int = 0  # free on the device, for every process
    limit_fraction: float = 1.0


class FragSample(msgspec.Struct, omit_defaults=True):
    """Allocator fragmentation from memory_snapshot() (without traces), at an adaptive rate."""

    device: int
    largest_free: int  # the largest inactive block inside a segment
    total_free: int  # all inactive blocks inside segments
    external: float  # 1 - largest_free / total_free (0 when nothing is free)
    segments: int
    segment_hist: dict[str, int] = {}  # segment count by size bucket
    expandable: bool = False
    cost_ms: float = 0.0  # what the snapshot call cost
    interval_s: float = 0.0  # the rate it runs at, adapted to stay under 0.1% of wall time


class GpuSample(msgspec.Struct, omit_defaults=True):
    """One GPU's state from NVML."""

    index: int  # the CUDA device index as the process sees it
    name: str = ""
    # None: NVML could not say (the device or driver does not report it)
    util_gpu: float | None = None  # percent
    util_mem: float | None = None
    mem_used: int = 0
    mem_total: int = 0
    power_w: float | None = None
    power_limit_w: float | None = None
    temp_c: float | None = None
    sm_clock_mhz: float | None = None
    throttle: list[str] = []
    pcie_tx_kbs: float | None = None  # on the slow sampler thread: the call waits in the driver
    pcie_rx_kbs: float | None = None
    # GPM counters (Hopper+, the slow thread: agent/telemetry/gpm.py): percent, and MiB/s
    sm_active: float | None = None  # share of SMs busy (NVML's util_gpu is "a kernel ran")
    sm_occupancy: float | None = None
    tensor_active: float | None = None  # tensor-pipe activity
    dram_bw: float | None = None
    nvlink_tx_mibs: float | None = None
    nvlink_rx_mibs: float | None = None
    sm_clock_max_mhz: float | None = None


class WorkerSample(msgspec.Struct, omit_defaults=True):
    """A child process of the training process (DataLoader workers among them)."""

    pid: int
    cpu_percent: float
    rss: int
    name: str = ""
    dataloader: bool = False
    # percent of the time its main thread was runnable but waiting for a CPU (Linux run-queue
    # delay, /proc/PID/schedstat); with cpu_percent, how busy it is on a shared machine
    wait_percent: float | None = None


class HostSample(msgspec.Struct, omit_defaults=True):
    """The training process and its machine, from psutil."""

    proc_cpu: float  # percent of one core (can exceed 100)
    proc_rss: int
    threads: int
    cpu_count: int
    proc_rss_peak: int = 0  # the process's peak resident memory so far (getrusage), 0 unknown
    cpu_per_core: list[float] = []
    mem_total: int = 0
    mem_available: int = 0
    mem_percent: float = 0.0
    workers: list[WorkerSample] = []


class MemoryLow(msgspec.Struct, array_like=True):
    """One second's low point of the training process's memory: RSS, and allocated CUDA memory
    on the first device (0 when there is none). The agent keeps ten minutes of them
    (agent/telemetry/memory_trend.py) for the leak rule of a monitor that joins later."""

    time: float  # unix seconds, the start of that second's samples
    rss: int
    allocated: int = 0
    steps: int | None = None  # training steps cut by then: a leak is judged per step


class Telemetry(msgspec.Struct, omit_defaults=True):
    """The latest samples; absent parts say why in `unavailable` (e.g. {"gpu": "no NVML"})."""

    time: float
    memory: list[MemorySample] = []
    frag: list[FragSample] = []
    gpus: list[GpuSample] = []
    host: HostSample | None = None
    unavailable: dict[str, str] = {}
    steps: int | None = None  # training steps cut when these were sampled (the leak rule's x axis)


class CaptureInfo(msgspec.Struct, omit_defaults=True, frozen=True):
    """One on-demand capture (profiler trace or CUDA memory snapshot) and how far it got.

    Frozen: the agent thread publishes a new one at each change (see capture/controller.py)."""

    id: int
    kind: CaptureKind
    state: CaptureState
    steps_total: int = 0
    steps_done: int = 0
    seconds: float = 0.0
    path: str = ""  # on the agent's host
    host: str = ""
    error: str = ""
    note: str = ""  # where files go when not where asked, and why (the directory was refused)
    requested_at: float = 0.0
    started_at: float = 0.0
    finished_at: float = 0.0
    summary: dict[str, Any] = {}
    start_step: int = -1  # the run's step count where it started (the first step captured)


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

    `t` is the agent's perf_counter_ns (the log's clock); `phase` an index into logcodes.PHASES
    (5: other), read off torchtop's wrapper frames on the stack (or the log's open explicit phase).
    `site` is the innermost frame of the user's own code ("path:line function"; a library's when
    none), `callee` the function it was in the middle of calling ("module:qualname"; "" when the
    site is the innermost Python frame). `sync`: the innermost frame sat at a call that a sync
    window saw synchronise the device, and the sample was taken on time (not `late`), so the
    training thread was blocked there. `late`: the sample came over 1 ms after it was due (the
    training thread held the GIL, so its stack was read where it let go of it).
    `caller`: where the user's function at `site` was called from ("path:line function": the
    next frame of the user's own code outward, past that function's own comprehensions and
    lambdas; "" when none). `input`: the thread was resuming the loop's input generator from
    the `for` statement of the loop that calls the model (a plain generator feeding the loop:
    data wait that no hook times).
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


class LogChunk(msgspec.Struct, array_like=True):
    """The probe's log entries drained at one agent tick, in order.

    `seq` counts the agent's chunks (consecutive: a gap means chunks were not received, and the
    replay forgets the open step). `steps` is the number of training steps the probe had cut when
    it was drained: a replay starting here numbers its steps from it.
    """

    seq: int
    steps: int
    entries: list[Union[int, tuple[Any, ...]]]
    pairs: bool = False  # entries as the training thread wrote them (time, code): see to_entries


class StepTally(msgspec.Struct, array_like=True):
    """Every training step of the run, counted: what a late joiner learns of the steps the
    history no longer holds (agent/loop/tally.py). `counts[k]` steps had ended by `ends[k]`;
    between two points they ended at times not kept. Times are the agent's perf_counter ns."""

    start: int  # the first time the run logged: its first step's start
    ends: list[int]  # step end times, oldest first, about `width_ns` apart or more
    counts: list[int]  # training steps ended up to and including each of `ends`
    width_ns: int = 0


class Hello(msgspec.Struct, tag="hello", omit_defaults=True):
    """Who the agent is; the reply to a `hello` request."""

    v: int
    run_id: str
    pid: int
    host: str
    port: int
    pub_port: int
    device: str  # "cpu" | "cuda"
    start_time: float
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device_name: str = ""
    torch_version: str = ""
    agent_version: str = ""
    argv: list[str] = []
    cuda_event_every: int = 0  # 0: no device timing; k: CUDA events on one step in k
    # the job this rank belongs to (agent/identity.py): "" for a process on its own. Ranks of one
    # job share it; two jobs on one machine never do (TORCHELASTIC_RUN_ID, SLURM job, rendezvous)
    job_id: str = ""
    launcher: str = ""  # "torchrun" | "slurm" | "torch.distributed" | "" (none seen)
    node_rank: int | None = None  # torchrun's GROUP_RANK / SLURM_NODEID; None unknown
    local_world_size: int = 0  # ranks on this node; 0 unknown
    backend: str = ""  # the default process group's backend once initialized: "gloo", "nccl", ...


class Batch(msgspec.Struct, tag="batch", omit_defaults=True):
    """What the agent publishes ~10 times a second, also when empty (it doubles as heartbeat)."""

    v: int
    run_id: str
    seq: int
    time: float
    log: list[LogChunk] = []  # new log chunks while anyone subscribes (recent ones again for a new one)
    wall_offset: float = 0.0  # unix time - perf_counter time on the agent: stamps to wall clock
    rank: int = 0
    dropped: int = 0  # cumulative steps the probe's bounded log dropped
    hook_errors: int = 0  # cumulative guarded failures inside hooks
    telemetry: Telemetry | None = None  # memory / GPU / host samples taken since last batch
    capture: CaptureInfo | None = None  # the capture in progress, or the last one
    why: Why | None = None  # stack samples, sync detection, FLOPs (docs/why.md)
    bad_requests: int = 0  # cumulative requests the agent refused as malformed or oversized
    dropped_requests: int = 0  # cumulative requests read and not answered (a flood, a banned peer)


class Request(msgspec.Struct, tag="request", omit_defaults=True):
    """A monitor's request on the agent's ROUTER socket."""

    v: int
    id: int
    cmd: str  # a request_commands.Command's value: a string on the wire
    args: dict[str, Any] = {}


class Reply(msgspec.Struct, tag="reply", omit_defaults=True):
    """The agent's answer to a `Request` with the same id."""

    v: int
    id: int
    ok: bool
    error: str = ""
    hello: Hello | None = None
    run_id: str = ""
    log: list[LogChunk] = []  # a snapshot's history, oldest first
    wall_offset: float = 0.0
    rank: int = 0
    seq: int = -1  # the last published batch sequence number when the reply was built
    data: dict[str, Any] = {}
    capture: Union[CaptureInfo, None] = None
    captures: list[CaptureInfo] = []
    memory: list[MemoryLow] = []  # snapshot and `memory` replies: per-second lows, oldest first
    tally: StepTally | None = None  # a snapshot's count of every step of the run


class RankSummary(msgspec.Struct, omit_defaults=True):
    """One rank as its node's relay sees it (docs/multi-rank.md): what the job view, the
    straggler rule and coverage read, without the rank's steps."""

    rank: int
    run_id: str
    seq: int = -1  # the rank's last batch the relay received
    age: float = -1.0  # seconds since then, on the relay's clock; -1: none yet
    gone: bool = False  # the rank stopped answering the relay
    batches: int = 0  # the rank's batches the relay received, cumulative
    steps: int = 0  # its train steps the relay counted
    last_i: int = -1  # its highest train step index
    hello: Hello | None = None  # sent while new and every few seconds
    # its 1-second step buckets since the relay's previous summary, the open second last:
    # [unix second, *sums] in monitor/model/rank_stats.py's slot order (SUMMARY_SLOTS of them)
    buckets: list[list[float]] = []
    telemetry: Telemetry | None = None  # the latest samples (no workers, no per-core figures)


class NodeSummary(msgspec.Struct, tag="summary", omit_defaults=True):
    """What a node's relay publishes once or twice a second: every rank of one job on its node."""

    v: int
    job_id: str
    node: str
    seq: int
    time: float
    relay_pid: int = 0
    ranks: list[RankSummary] = []
    received: int = 0  # batches the relay received from its ranks, cumulative
    bad_frames: int = 0  # frames from its ranks it refused, cumulative


#: Values in a summary bucket after its second: steps, wall, timed, their wall, 7 phases,
#: sampled, 6 device keys, steps whose batch was seen and their samples, tokens, sequence
#: (rank_stats.SIZE; a test holds the two equal).
SUMMARY_SLOTS = 22

Message = Union[Hello, Batch, Request, Reply, NodeSummary]


class _Header(msgspec.Struct):
    v: int


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_header_decoder = msgspec.msgpack.Decoder(_Header)
# What msgspec may raise on hostile input besides its own errors: invalid UTF-8 in a tag
# (UnicodeDecodeError, a ValueError) and nesting deeper than its limit (RecursionError).
_DECODE_ERRORS = (msgspec.MsgspecError, ValueError, RecursionError)


def encode(msg: Message) -> bytes:
    """Encode one message to a msgpack frame."""
    return _encoder.encode(msg)


def decode(frame: bytes, versions: tuple[int, ...] = (PROTOCOL_VERSION,)) -> Message:
    """Decode and validate one frame (its numbers too: numbers.py); raise WireError with a
    readable reason otherwise. `versions`: the protocol versions accepted (a recording's
    reader accepts older ones it can upgrade: recording_compat.py)."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise WireError(f"frame is {type(frame).__name__}, not bytes")
    if len(frame) > MAX_FRAME_BYTES:
        raise WireError(f"frame of {len(frame)} bytes exceeds the {MAX_FRAME_BYTES} byte limit")
    try:
        header = _header_decoder.decode(frame)
    except _DECODE_ERRORS as exc:
        raise WireError(f"malformed frame: {exc}") from None
    if header.v not in versions:
        raise WireError(
            f"protocol version {header.v}, this torchtop speaks {PROTOCOL_VERSION}: "
            "install the same torchtop version on both sides"
        )
    try:
        msg = _decoder.decode(frame)
    except _DECODE_ERRORS as exc:
        raise WireError(f"invalid message: {exc}") from None
    bad = bad_number(msg)
    if bad is not None:
        raise WireError(
            f"invalid message: a number out of range: {bad[:200]} "
            f"(a number must be finite, within ±{FLOAT_LIMIT:g}, an int within int64)"
        )
    return msg
