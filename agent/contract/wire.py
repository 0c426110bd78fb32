"""The messages between agent and monitor.

msgspec Structs encoded as msgpack, one tagged union (`Message`), a protocol version in every
frame. Nothing is ever pickled; every frame is validated on decode. The log the messages carry
is described in logcodes.py.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

PROTOCOL_VERSION = 5
MAX_FRAME_BYTES = 16 * 1024 * 1024
#: The most steps a `snapshot` request may ask for.
SNAPSHOT_MAX_STEPS = 16_000


class WireError(ValueError):
    """A frame that is not a valid torchtop message of this protocol version."""


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
    util_gpu: float = -1.0  # percent; -1 when not known
    util_mem: float = -1.0
    mem_used: int = 0
    mem_total: int = 0
    power_w: float = -1.0
    power_limit_w: float = -1.0
    temp_c: float = -1.0
    sm_clock_mhz: float = -1.0
    throttle: list[str] = []
    pcie_tx_kbs: float = -1.0  # sampled at <= 1 Hz: the call takes ~20 ms
    pcie_rx_kbs: float = -1.0


class WorkerSample(msgspec.Struct, omit_defaults=True):
    """A child process of the training process (DataLoader workers among them)."""

    pid: int
    cpu_percent: float
    rss: int
    name: str = ""
    dataloader: bool = False


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


class Telemetry(msgspec.Struct, omit_defaults=True):
    """The latest samples; absent parts say why in `unavailable` (e.g. {"gpu": "no NVML"})."""

    time: float
    memory: list[MemorySample] = []
    frag: list[FragSample] = []
    gpus: list[GpuSample] = []
    host: HostSample | None = None
    unavailable: dict[str, str] = {}


class CaptureInfo(msgspec.Struct, omit_defaults=True):
    """One on-demand capture (profiler trace or CUDA memory snapshot) and how far it got."""

    id: int
    kind: str  # "profile" | "memory"
    state: str  # "pending" | "running" | "writing" | "done" | "failed"
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
    node_rank: int = -1  # torchrun's GROUP_RANK / SLURM_NODEID; -1 unknown
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


class Request(msgspec.Struct, tag="request", omit_defaults=True):
    """A monitor's request on the agent's ROUTER socket."""

    v: int
    id: int
    cmd: str  # "hello" | "snapshot" | "ping"
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


Message = Union[Hello, Batch, Request, Reply]


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


def decode(frame: bytes) -> Message:
    """Decode and validate one frame; raise WireError with a readable reason otherwise."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise WireError(f"frame is {type(frame).__name__}, not bytes")
    if len(frame) > MAX_FRAME_BYTES:
        raise WireError(f"frame of {len(frame)} bytes exceeds the {MAX_FRAME_BYTES} byte limit")
    try:
        header = _header_decoder.decode(frame)
    except _DECODE_ERRORS as exc:
        raise WireError(f"malformed frame: {exc}") from None
    if header.v != PROTOCOL_VERSION:
        raise WireError(
            f"protocol version {header.v}, this torchtop speaks {PROTOCOL_VERSION}: "
            "install the same torchtop version on both sides"
        )
    try:
        return _decoder.decode(frame)
    except _DECODE_ERRORS as exc:
        raise WireError(f"invalid message: {exc}") from None
