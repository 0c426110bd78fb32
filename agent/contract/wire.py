"""The messages between agent and monitor.

msgspec Structs encoded as msgpack, one tagged union (`Message`), a protocol version in every
frame. Nothing is ever pickled; every frame is validated on decode. The log the messages carry
is described in logcodes.py. The structs a message nests are grouped by what they carry:
capture.py, telemetry.py, why.py (their names are importable from here too).
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from torchtop.contract.capture import CAPTURE_ACTIVE as CAPTURE_ACTIVE
from torchtop.contract.capture import CAPTURE_DEFAULT_STEPS as CAPTURE_DEFAULT_STEPS
from torchtop.contract.capture import CaptureInfo as CaptureInfo
from torchtop.contract.capture import CaptureKind as CaptureKind
from torchtop.contract.capture import CaptureState as CaptureState
from torchtop.contract.numbers import FLOAT_LIMIT, bad_number
from torchtop.contract.relay import SUMMARY_VERSION as SUMMARY_VERSION
from torchtop.contract.relay import Second as Second
from torchtop.contract.telemetry import FragSample as FragSample
from torchtop.contract.telemetry import GpuSample as GpuSample
from torchtop.contract.telemetry import HostSample as HostSample
from torchtop.contract.telemetry import MemoryLimit as MemoryLimit
from torchtop.contract.telemetry import MemoryLow as MemoryLow
from torchtop.contract.telemetry import MemorySample as MemorySample
from torchtop.contract.telemetry import Telemetry as Telemetry
from torchtop.contract.telemetry import WorkerSample as WorkerSample
from torchtop.contract.why import FlopInfo as FlopInfo
from torchtop.contract.why import StackSample as StackSample
from torchtop.contract.why import SyncInfo as SyncInfo
from torchtop.contract.why import SyncSite as SyncSite
from torchtop.contract.why import Why as Why

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


class WireError(ValueError):
    """A frame that is not a valid torchtop message of this protocol version."""


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
    # its 1-second step buckets since the relay's previous summary, the open second last
    # (relay.py: named, append-only; on the wire the list of numbers they always were)
    buckets: list[Second] = []
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
    # the buckets' layout (relay.py; absent: 1, before they had names); a newer one's extra
    # figures are ignored, an older one's missing ones unknown
    summary_v: int = 1
    duplicates: list[str] = []  # ranks two of its node's agents claim: "rank 1: pids 41, 97"


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


def decode(frame: bytes | bytearray | memoryview, versions: tuple[int, ...] = (PROTOCOL_VERSION,)) -> Message:
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
