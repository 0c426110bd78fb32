"""The report's types: what `torchtop report` prints, as msgspec structs (issue 27).

Export, compare and the job report read these by attribute, so a renamed field is a type error
rather than a metric silently gone. Their encoding (msgspec.to_builtins, then json.dumps) is the
report's JSON as it was when it was a dict, key for key and in the same order: fields are
declared in that order, a key the report leaves out where it does not apply is UNSET (always
left out), and the host section drops its defaults as the agent's HostSample does.

Every field has a default, so that a report another torchtop version wrote decodes
(`decode_report`) with what it lacks at its default (None: not known). Pure: no torch, no zmq.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType, field

from torchtop.contract.wire import FragSample, GpuSample, MemorySample, WorkerSample
from torchtop.monitor.model.energy import Energy


class ReportError(ValueError):
    """A report file that is not a report: its one line says what is wrong."""


# -- the diagnosis -------------------------------------------------------------------------------
class UpsideReport(msgspec.Struct):
    text: str = ""
    kind: str = ""
    step_ms: float | None = None
    new_step_ms: float | None = None
    speedup: float | None = None


class FindingReport(msgspec.Struct):
    """A verdict or a flag (diagnosis/facts.py Finding)."""

    kind: str = "unknown"
    severity: str = "ok"
    share: float = 0.0
    evidence: list[str] = field(default_factory=list[str])
    advice: list[str] = field(default_factory=list[str])
    upside: UpsideReport | None = None


# -- the run's figures ---------------------------------------------------------------------------
class StepTimeMs(msgspec.Struct):
    """A rank read through its node's relay has no steps here: only a mean (median, p90 UNSET)."""

    median: float | UnsetType = UNSET
    p90: float | UnsetType = UNSET
    mean: float = 0.0


class EvalLatency(msgspec.Struct):
    p50: float = 0.0
    p99: float = 0.0


class AgentRefused(msgspec.Struct):
    bad: int = 0
    dropped: int = 0


class MemoryDevice(MemorySample, kw_only=True):
    """One device's latest allocator sample (its defaults left out, as on the wire), and more."""

    window_peak_max: int
    rounding_waste: int
    reserved_fraction: float | None
    fragmentation: FragSample | None


class MemorySection(msgspec.Struct):
    """Available: the devices, and the first device's figures; else `reason`."""

    available: bool = False
    devices: list[MemoryDevice] | UnsetType = UNSET
    alloc_retries_per_s: float | UnsetType = UNSET
    allocated: int | UnsetType = UNSET
    reserved: int | UnsetType = UNSET
    peak_allocated: int | UnsetType = UNSET
    inactive_split: int | UnsetType = UNSET
    alloc_retries: int | UnsetType = UNSET
    ooms: int | UnsetType = UNSET
    reason: str | UnsetType = UNSET


class GpuSection(msgspec.Struct):
    available: bool = False
    devices: list[GpuSample] | UnsetType = UNSET
    reason: str | UnsetType = UNSET


class HostSection(msgspec.Struct):
    """The agent's HostSample after `available`, with the fields its encoding has (its defaults
    are left out, as on the wire) and `workers` always; unavailable: `reason` alone."""

    available: bool = False
    proc_cpu: float | UnsetType = UNSET
    proc_rss: int | UnsetType = UNSET
    threads: int | UnsetType = UNSET
    cpu_count: int | UnsetType = UNSET
    proc_rss_peak: int | UnsetType = UNSET
    cpu_per_core: list[float] | UnsetType = UNSET
    mem_total: int | UnsetType = UNSET
    mem_available: int | UnsetType = UNSET
    mem_percent: float | UnsetType = UNSET
    workers: list[WorkerSample] | UnsetType = UNSET
    train_wait_percent: float | UnsetType = UNSET  # the training thread's wait for a CPU, last second
    reason: str | UnsetType = UNSET


class SyncSiteReport(msgspec.Struct):
    site: str = ""
    call: str | None = None
    via: str | None = None
    line: str | None = None
    calls_per_step: float | None = None
    wait_ms_per_step: float | None = None
    share: float | None = None


class SyncSection(msgspec.Struct):
    """Sync detection; `reason` to `sites` only where the agent sent its sync state."""

    state: str = "unknown"
    reason: str | None | UnsetType = UNSET
    windows: int | UnsetType = UNSET
    cost_us_per_sync: float | None | UnsetType = UNSET
    sites: list[SyncSiteReport] | UnsetType = UNSET
    share: float | None = None
    wait_ms_per_step: float | None = None


class StackSamples(msgspec.Struct):
    hz: float = 0.0
    in_steps: int = 0
    late: int = 0
    by_phase: dict[str, int] = field(default_factory=dict[str, int])
    cost_us: float | None = None


class HotSite(msgspec.Struct):
    """A line (hot_frames) or a function of the user's (hot_functions, with its `caller`)."""

    site: str = ""
    callee: str = ""
    samples: int = 0
    share: float = 0.0
    caller: str | UnsetType = UNSET


class ThroughputReport(msgspec.Struct):
    steps_per_s: float | None = None
    samples_per_s: float | None = None
    samples_from: str | None = None
    tokens_per_s: float | None = None
    tokens_from: str | None = None
    flops_per_step: int | None = None
    flops_from: str | None = None
    flops_note: str | None = None
    achieved_tflops: float | None = None
    precision: str | None = None
    peak_tflops: float | None = None
    peak_from: str | None = None
    mfu: float | None = None
    device_busy: float | None = None
    device_busy_ms: float | None = None
    device_step_ms: float | None = None
    gpu_util: float | None = None
    mfu_from: str | None = None  # "flop count" | "gpu counters"
    mfu_note: str | None = None  # why MFU is unknown, or why it is the counters'


class OomForecastReport(msgspec.Struct):
    """When memory in use reaches its limit at its steady growth (diagnosis/oom.py)."""

    steps: int = 0  # training steps left
    seconds: float = 0.0  # ... at the judged step rate
    limit_bytes: int = 0
    limit_from: str = ""  # "device", "cgroup memory.max", "machine", "TORCHTOP_MEMORY_LIMIT" ...
    rate_bytes_per_step: float = 0.0
    in_use_bytes: int = 0
    confidence: str = ""  # "low" | "moderate" | "high"
    text: str = ""


def _memory() -> MemorySection:
    return MemorySection(reason="no telemetry received")


def _gpu() -> GpuSection:
    return GpuSection(reason="no telemetry received")


def _host() -> HostSection:
    return HostSection(available=False, reason="no telemetry received")


EventRole = Literal["verdict", "flag", "resumed"]


class Event(msgspec.Struct, frozen=True):
    """A change (diagnosis/events.py): when (the agent's wall clock), its kind (a verdict or flag
    kind, or `resumed`), severity, the verdict's or flag's first line, and what changed."""

    time: float
    kind: str
    severity: str
    line: str
    role: EventRole


class RunReport(msgspec.Struct):
    """One run's report (diagnosis/report.py run_report)."""

    target: str = ""
    seconds: float = 0.0
    history: bool = False
    covered_s: float = 0.0
    run_id: str = ""
    pid: int | None = None
    hostname: str | None = None
    device: str = "cpu"
    device_name: str = ""
    ranks: list[int] = field(default_factory=list[int])
    steps: int = 0
    steps_in_full: int = 0
    thinned: bool = False
    eval_steps: int = 0
    eval_latency_ms: EvalLatency | None = None
    timed_steps: int = 0
    micro_batches: float = 0.0
    step_time_ms: StepTimeMs = field(default_factory=StepTimeMs)
    steps_per_s: float = 0.0
    breakdown: dict[str, float] = field(default_factory=dict[str, float])
    phase_ms: dict[str, float] = field(default_factory=dict[str, float])
    device_ms: dict[str, float] = field(default_factory=dict[str, float])
    batches: int = 0
    dropped: int = 0
    gaps: int = 0
    bad_frames: int = 0
    hook_errors: int = 0
    agent_refused: AgentRefused = field(default_factory=AgentRefused)
    memory: MemorySection = field(default_factory=_memory)
    gpu: GpuSection = field(default_factory=_gpu)
    host: HostSection = field(default_factory=_host)
    sync: SyncSection = field(default_factory=SyncSection)
    stack_samples: StackSamples = field(default_factory=StackSamples)
    hot_frames: dict[str, list[HotSite]] = field(default_factory=dict[str, list[HotSite]])
    hot_functions: dict[str, list[HotSite]] = field(default_factory=dict[str, list[HotSite]])
    throughput: ThroughputReport = field(default_factory=ThroughputReport)
    verdict: FindingReport = field(default_factory=FindingReport)
    flags: list[str] = field(default_factory=list[str])
    flag_details: list[FindingReport] = field(default_factory=list[FindingReport])
    energy: Energy | None = None  # the window's joules a step / sample / token (model/energy.py)
    oom_forecast: OomForecastReport | None = None  # time to the memory limit; None: no steady growth
    # what the memory the leak rule judges may reach: the device's on CUDA, the host's on CPU, or
    # the user's where lower (diagnosis/oom.py limit_of); None: not known
    memory_limit_bytes: int | None = None
    events: list[Event] = field(default_factory=list[Event])  # the window's (diagnosis/events.py)


def decode_report(data: bytes | str | dict[str, Any], source: str = "report") -> RunReport:
    """A run's report from its JSON (or that JSON parsed), as any torchtop version wrote it: what
    it lacks is left at its default, what it has more is ignored. ReportError: one line."""
    try:
        if isinstance(data, dict):
            return msgspec.convert(data, RunReport)
        return msgspec.json.decode(data, type=RunReport)
    except msgspec.DecodeError as exc:  # ValidationError among them
        raise ReportError(f"{source} is not a torchtop report: {exc}") from None


# -- a job's report (diagnosis/job.py job_report) ------------------------------------------------
class WorkReport(msgspec.Struct):
    """A rank's work a step; a rank entry's adds its live throughput (tokens_per_s None: its
    batches have no sequence)."""

    samples: float = 0.0
    tokens: float = 0.0
    seq: float = 0.0
    samples_per_s: float | UnsetType = UNSET
    tokens_per_s: float | None | UnsetType = UNSET


class RankEntry(msgspec.Struct):
    """One rank of the job: its own figures, the job's line for it, how it is read."""

    rank: int = -1
    local_rank: int | None = None
    node: str = ""
    pid: int | None = None
    target: str = ""
    status: str = ""
    agent_version: str | None = None
    comm_ms: float = 0.0
    comm_source: str = "host"
    busy_ms: float = 0.0
    steps: int = 0
    steps_in_full: int = 0
    timed_steps: int = 0
    step_time_ms: StepTimeMs = field(default_factory=StepTimeMs)
    steps_per_s: float = 0.0
    breakdown: dict[str, float] = field(default_factory=dict[str, float])
    phase_ms: dict[str, float] = field(default_factory=dict[str, float])
    device_ms: dict[str, float] = field(default_factory=dict[str, float])
    memory: MemorySection = field(default_factory=_memory)
    gpu: GpuSection = field(default_factory=_gpu)
    host: HostSection = field(default_factory=_host)
    verdict: FindingReport = field(default_factory=FindingReport)
    flags: list[str] = field(default_factory=list[str])
    dropped: int = 0
    gaps: int = 0
    bad_frames: int = 0
    hook_errors: int = 0
    comm_by_group_ms: dict[str, float] = field(default_factory=dict[str, float])
    work: WorkReport | None = None
    # ms a timed step its pipeline schedule waited for its neighbour stages, and that over its
    # step: the bubble (diagnosis/bubble.py); None: not a pipeline stage, or not known here
    pipeline_bubble_ms: float | None = None
    pipeline_bubble_share: float | None = None
    via: str | UnsetType = UNSET  # "relay": read through its node's relay
    error: str | UnsetType = UNSET
    energy: Energy | None = None  # its GPUs' (on CPU its node's packages') over the window


class SilentNode(msgspec.Struct):
    node: str = ""
    silent_s: float = 0.0


class CoverageReport(msgspec.Struct):
    reporting: int = 0
    expected: int = 0
    line: str = ""
    silent_nodes: list[SilentNode] = field(default_factory=list[SilentNode])
    relays: list[str] = field(default_factory=list[str])
    unreached: list[str] = field(default_factory=list[str])


class JobFigures(msgspec.Struct):
    """The job's aggregate steps (the mean rank)."""

    steps: int = 0
    steps_in_full: int = 0
    timed_steps: int = 0
    covered_s: float = 0.0
    step_time_ms: StepTimeMs = field(default_factory=StepTimeMs)
    steps_per_s: float = 0.0
    breakdown: dict[str, float] = field(default_factory=dict[str, float])
    phase_ms: dict[str, float] = field(default_factory=dict[str, float])
    device_ms: dict[str, float] = field(default_factory=dict[str, float])


class CollectiveReport(msgspec.Struct):
    source: str = "host"
    comm_ms: dict[str, float] = field(default_factory=dict[str, float])
    median_ms: float = 0.0
    min_ms: float = 0.0
    max_ms: float = 0.0


class StragglerReport(msgspec.Struct):
    rank: int = -1
    phase: str | None = None
    phase_ms: float = 0.0
    median_ms: float = 0.0
    others_wait_ms: float = 0.0
    step_ms: float = 0.0
    waiting_ranks: int = 0
    share: float = 0.0
    slowdown: float = 0.0
    severity: str = ""
    work: WorkReport | None = None
    median_work: WorkReport | None = None
    work_ratio: float | None = None
    imbalance: bool = False
    persistence: str | None = None  # "chronic" | "one-off"; None: too few spans to say
    slowest_in_spans: list[int] = field(default_factory=list[int])
    new_step_ms: float | None = None  # the what-if: the step without its excess (job_model.py)
    noise_band_ms: float | None = None  # the band its own time cleared
    ahead_in_seconds: list[int] = field(default_factory=list[int])  # [seconds ahead by more, seconds]


class ScalingReport(msgspec.Struct):
    step_ms: float = 0.0
    compute_ms: float = 0.0
    efficiency: float = 0.0
    lost_to_communication: float = 0.0
    lost_to_waiting: float = 0.0
    lost_to_other: float = 0.0
    baseline_ms: float | None = None
    vs_baseline: float | None = None


class JobReport(msgspec.Struct):
    """A job's report: the job, its ranks, the collective figures, the straggler, the scaling."""

    target: str = ""
    job_id: str = ""
    seconds: float = 0.0
    history: bool = False
    world_size: int = 0
    nodes: list[str] = field(default_factory=list[str])
    device: str = "cpu"
    ranks: list[RankEntry] = field(default_factory=list[RankEntry])
    coverage: CoverageReport = field(default_factory=CoverageReport)
    job: JobFigures = field(default_factory=JobFigures)
    collective: CollectiveReport = field(default_factory=CollectiveReport)
    straggler: StragglerReport | None = None
    scaling: ScalingReport | None = None
    versions: dict[str, list[int]] = field(default_factory=dict[str, list[int]])
    notes: list[str] = field(default_factory=list[str])
    verdict: FindingReport = field(default_factory=FindingReport)
    flags: list[str] = field(default_factory=list[str])
    flag_details: list[FindingReport] = field(default_factory=list[FindingReport])
    energy: Energy | None = None  # the ranks' GPUs summed (on CPU one rank a node: model/energy.py)
    events: list[Event] = field(default_factory=list[Event])  # seen while a live report collected
