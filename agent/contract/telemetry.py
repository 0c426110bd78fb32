"""Telemetry on the wire: the memory, GPU and host samples a Batch carries, and the per-second
memory lows a snapshot replies with (the leak rule's)."""

from __future__ import annotations

from typing import Annotated

import msgspec

MAX_COLLECTIVE_GROUPS = 16  # process groups a batch names (the longest waits first)
MAX_COLLECTIVE_TEXT = 64  # a group's name and an op's, clipped


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
    # NVML's total energy since the driver loaded, mJ (Volta+ data-center GPUs; None: unsupported)
    energy_mj: int | None = None


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
    # percent of the last second the training thread was runnable but waiting for a CPU (Linux
    # run-queue delay, /proc/self/task/TID/schedstat): a rank slow because its host is
    # oversubscribed, not because of its work; None where the kernel does not say
    train_wait_percent: float | None = None


class MemoryLimit(msgspec.Struct, omit_defaults=True):
    """What this process's memory may reach, read on the agent's slow sampler thread
    (agent/telemetry/memory_limit.py): the time-to-limit forecast's ceiling on CPU, and the user's
    own limit on either device."""

    # the smallest of the host's limits on this process (cgroup, RLIMIT_AS / RLIMIT_DATA, the
    # machine's memory) and the user's; 0: none known
    limit: Annotated[int, msgspec.Meta(ge=0)] = 0
    source: Annotated[str, msgspec.Meta(max_length=MAX_COLLECTIVE_TEXT)] = ""  # "cgroup memory.max" ...
    user: Annotated[int, msgspec.Meta(ge=0)] = 0  # TORCHTOP_MEMORY_LIMIT / start(memory_limit=); 0: none


class MemoryLow(msgspec.Struct, array_like=True):
    """One second's low point of the training process's memory: RSS, and allocated CUDA memory
    on the first device (0 when there is none). The agent keeps ten minutes of them
    (agent/telemetry/memory_trend.py) for the leak rule of a monitor that joins later."""

    time: float  # unix seconds, the start of that second's samples
    rss: int
    allocated: int = 0
    steps: int | None = None  # training steps cut by then: a leak is judged per step


class Collective(msgspec.Struct, omit_defaults=True):
    """One process group's place in its collectives, from torch's flight recorder, sent while the
    run is stalled (agent/telemetry/flight.py)."""

    group: Annotated[str, msgspec.Meta(max_length=MAX_COLLECTIVE_TEXT)]  # its group_desc, or "pg ID"
    # the group's name in torch (the same on each of its ranks; two groups may share a desc)
    group_id: Annotated[str, msgspec.Meta(max_length=MAX_COLLECTIVE_TEXT)]
    op: Annotated[str, msgspec.Meta(max_length=MAX_COLLECTIVE_TEXT)]  # "all_reduce"
    seq: Annotated[int, msgspec.Meta(ge=0)]  # the collective named: the oldest not completed, else the last
    last_seq: Annotated[int, msgspec.Meta(ge=0)]  # the last one this rank entered
    # "scheduled" / "started" / "completed" (NCCL's); "" unknown (gloo's stay "scheduled" when done)
    state: Annotated[str, msgspec.Meta(max_length=MAX_COLLECTIVE_TEXT)] = ""
    age_s: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0  # since the named one was entered


class Telemetry(msgspec.Struct, omit_defaults=True):
    """The latest samples; absent parts say why in `unavailable` (e.g. {"gpu": "no NVML"})."""

    time: float
    memory: list[MemorySample] = []
    frag: list[FragSample] = []
    gpus: list[GpuSample] = []
    host: HostSample | None = None
    unavailable: dict[str, str] = {}
    steps: int | None = None  # training steps cut when these were sampled (the leak rule's x axis)
    # the CPU packages' energy from RAPL since the agent started reading it, joules, its wraps
    # undone (agent/telemetry/rapl.py); the whole machine's CPUs, not this process's; None: unreadable
    cpu_energy_j: float | None = None
    # each process group's place from torch's flight recorder, only while stalled ([] otherwise)
    collectives: Annotated[list[Collective], msgspec.Meta(max_length=MAX_COLLECTIVE_GROUPS)] = []
    memory_limit: MemoryLimit | None = None  # None: not read (an older agent, or no host sampler)
