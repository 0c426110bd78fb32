"""One agent's state as metric samples: what Prometheus and OpenTelemetry both export. Pure.

Labels are bounded: job, node, rank on every sample; phase on per-phase ones; the verdict or
flag kind (closed sets: diagnosis/verdicts.py, flags.py) on those. Units are seconds, bytes,
ratios (0..1, `_ratio`) and CPU cores (`_cores`, above 1 for a process on several), as
Prometheus names them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from msgspec import UnsetType

from torchtop.monitor.diagnosis.facts import SEVERITY_RANK
from torchtop.monitor.diagnosis.report_types import RunReport

if TYPE_CHECKING:
    from torchtop.monitor.diagnosis.events import EventLog

Kind = Literal["gauge", "counter"]
_SEVERITY_RANK: dict[str, int] = {**SEVERITY_RANK}  # a report's severity is any str, read from JSON


@dataclass(frozen=True)
class Sample:
    name: str
    value: float
    labels: tuple[tuple[str, str], ...]
    kind: Kind = "gauge"


#: name -> (kind, help, extra label): every metric the exporters may publish
METRICS: dict[str, tuple[Kind, str, str | None]] = {
    "torchtop_up": ("gauge", "1 while the agent answers, 0 once it is gone", None),
    "torchtop_steps": ("counter", "training steps the agent has counted", None),
    "torchtop_steps_per_second": ("gauge", "training steps per second over the window", None),
    "torchtop_step_time_median_seconds": ("gauge", "median step time over the window", None),
    "torchtop_step_time_p90_seconds": ("gauge", "90th percentile step time over the window", None),
    "torchtop_step_time_mean_seconds": ("gauge", "mean step time over the window", None),
    "torchtop_phase_seconds": ("gauge", "host time per step in each phase (timed steps)", "phase"),
    "torchtop_phase_share_ratio": ("gauge", "each phase's share of the step (timed steps)", "phase"),
    "torchtop_device_phase_seconds": ("gauge", "CUDA-event time per sampled step, by phase", "phase"),
    "torchtop_memory_allocated_bytes": ("gauge", "CUDA memory allocated by tensors", None),
    "torchtop_memory_reserved_bytes": ("gauge", "CUDA memory held by the caching allocator", None),
    "torchtop_memory_peak_allocated_bytes": ("gauge", "CUDA peak allocated since start", None),
    "torchtop_memory_alloc_retries": ("counter", "cudaMalloc retries after flushing the cache", None),
    "torchtop_memory_ooms": ("counter", "CUDA out-of-memory errors", None),
    "torchtop_gpu_utilization_ratio": ("gauge", "NVML GPU utilisation", None),
    "torchtop_gpu_memory_used_bytes": ("gauge", "NVML memory used on the GPU (all processes)", None),
    "torchtop_gpu_power_watts": ("gauge", "NVML power draw", None),
    "torchtop_gpu_temperature_celsius": ("gauge", "NVML GPU temperature", None),
    "torchtop_energy_joules": ("counter", "NVML's energy counter since the driver loaded, by GPU", "source"),
    "torchtop_power_watts": ("gauge", "mean power over the window from the energy counters", "source"),
    "torchtop_energy_per_step_joules": ("gauge", "joules a training step (the GPUs, else the CPUs)", None),
    "torchtop_oom_eta_seconds": (
        "gauge",
        "seconds until memory in use reaches its limit at its steady growth (absent: no growth)",
        None,
    ),
    "torchtop_memory_limit_bytes": ("gauge", "the memory limit the OOM forecast counts to", None),
    "torchtop_process_cpu_cores": ("gauge", "training process CPU, in cores", None),
    "torchtop_process_resident_bytes": ("gauge", "training process resident memory", None),
    "torchtop_process_resident_peak_bytes": ("gauge", "training process peak resident memory", None),
    "torchtop_dataloader_workers": ("gauge", "DataLoader worker processes", None),
    "torchtop_dataloader_worker_cpu_cores": ("gauge", "DataLoader workers' mean CPU, in cores", None),
    "torchtop_verdict": (
        "gauge",
        "the verdict in force: its severity (0 ok .. 3 critical)",
        "verdict,severity",
    ),
    "torchtop_verdict_share_ratio": ("gauge", "the verdict's share of the step", "verdict"),
    "torchtop_flag": ("gauge", "a flag raised: its severity (1 info .. 3 critical)", "flag"),
    "torchtop_events": ("counter", "changes of verdict, stalls, resumes, flags raised", "kind,severity"),
    "torchtop_stalled_seconds": (
        "gauge",
        "how long no step has ended, once a stall (0 while steps end)",
        None,
    ),
    "torchtop_dropped_steps": ("counter", "steps the agent's bounded log dropped", None),
    "torchtop_hook_errors": ("counter", "guarded failures inside the agent's hooks", None),
    # a job's, from its ranks' buckets (export/job_figures.py)
    "torchtop_rank_reporting": ("gauge", "1 while the rank's figures are current", None),
    "torchtop_rank_step_seconds": ("gauge", "the rank's mean step time over the window", None),
    "torchtop_rank_own_seconds": ("gauge", "the rank's step less its collective wait", None),
    "torchtop_rank_comm_seconds": ("gauge", "the rank's exposed collective wait a step", None),
    "torchtop_rank_phase_seconds": ("gauge", "the rank's time a step in each phase", "phase"),
    "torchtop_job_ranks_reporting": ("gauge", "ranks of the job whose figures are current", None),
    "torchtop_job_ranks_expected": ("gauge", "the job's world size", None),
    "torchtop_job_nodes_silent": ("gauge", "nodes none of whose ranks report", None),
    "torchtop_job_straggler_rank": ("gauge", "the rank the others wait for (-1: none)", None),
    "torchtop_job_straggler_wait_share_ratio": (
        "gauge",
        "the share of the step the others wait for it",
        None,
    ),
    "torchtop_job_straggler_slowdown": ("gauge", "the job's step over its other ranks' pace", None),
    "torchtop_job_straggler_severity": ("gauge", "the straggler's severity (0 none .. 3 critical)", None),
}


def samples(
    report: RunReport,
    job: str,
    node: str,
    rank: int,
    up: bool,
    steps_total: int,
    steps_per_s: float | None,
    events: EventLog | None = None,
    stalled_s: float | None = None,
) -> list[Sample]:
    """The samples of one agent from its report (diagnosis/report.py). `steps_total` and
    `steps_per_s` are the agent's own counts: exact even where the exporter replays only a
    sample of the steps. `steps_per_s` None (not yet known) leaves that sample out. `events`:
    the agent's event log (its counts), `stalled_s`: its stall's length (events.stalled_s)."""
    base = (("job", job), ("node", node), ("rank", str(rank)))
    out: list[Sample] = []

    def add(name: str, value: float | UnsetType | None, *extra: tuple[str, str]) -> None:
        if value is None or isinstance(value, (bool, UnsetType)):
            return
        kind = METRICS[name][0]
        out.append(Sample(name, float(value), base + extra, kind))

    add("torchtop_up", 1 if up else 0)
    add("torchtop_steps", steps_total)
    add("torchtop_steps_per_second", steps_per_s)
    if report.steps:
        st = report.step_time_ms
        for q, ms in (("median", st.median), ("p90", st.p90), ("mean", st.mean)):
            add(f"torchtop_step_time_{q}_seconds", None if isinstance(ms, UnsetType) else ms / 1e3)
    if report.timed_steps:
        for phase, ms in report.phase_ms.items():
            add("torchtop_phase_seconds", ms / 1e3, ("phase", phase))
        for phase, share in report.breakdown.items():
            add("torchtop_phase_share_ratio", share, ("phase", phase))
    for phase, ms in report.device_ms.items():
        add("torchtop_device_phase_seconds", ms / 1e3, ("phase", phase))
    memory = report.memory
    if memory.available:
        add("torchtop_memory_allocated_bytes", memory.allocated)
        add("torchtop_memory_reserved_bytes", memory.reserved)
        add("torchtop_memory_peak_allocated_bytes", memory.peak_allocated)
        add("torchtop_memory_alloc_retries", memory.alloc_retries)
        add("torchtop_memory_ooms", memory.ooms)
    gpus = report.gpu.devices or []
    if gpus:
        g = gpus[0]  # the rank's own device comes first
        util = g.util_gpu
        add("torchtop_gpu_utilization_ratio", util / 100 if util is not None and util >= 0 else None)
        add("torchtop_gpu_memory_used_bytes", g.mem_used)
        add("torchtop_gpu_power_watts", _known(g.power_w))
        add("torchtop_gpu_temperature_celsius", _known(g.temp_c))
    for g in gpus:  # every GPU the rank uses: their energy is the rank's
        if g.energy_mj is not None and g.energy_mj >= 0:
            add("torchtop_energy_joules", g.energy_mj / 1000, ("source", f"gpu{g.index}"))
    energy = report.energy
    if energy is not None:
        for source, e in energy.sources.items():
            add("torchtop_power_watts", e.watts, ("source", source))
        add("torchtop_energy_per_step_joules", energy.joules_per_step)
    oom = report.oom_forecast
    if oom is not None:
        add("torchtop_oom_eta_seconds", oom.seconds)
    add("torchtop_memory_limit_bytes", report.memory_limit_bytes)
    host = report.host
    if host.available:
        add("torchtop_process_cpu_cores", (host.proc_cpu or 0) / 100)
        add("torchtop_process_resident_bytes", host.proc_rss)
        add("torchtop_process_resident_peak_bytes", host.proc_rss_peak or None)
        workers = [w for w in host.workers or [] if w.dataloader]
        add("torchtop_dataloader_workers", len(workers))
        if workers:
            add(
                "torchtop_dataloader_worker_cpu_cores",
                sum(w.cpu_percent for w in workers) / len(workers) / 100,
            )
    verdict = report.verdict
    if verdict.kind and verdict.kind != "unknown":
        add(
            "torchtop_verdict",
            _SEVERITY_RANK.get(verdict.severity, 0),
            ("verdict", verdict.kind),
            ("severity", verdict.severity),
        )
        add("torchtop_verdict_share_ratio", verdict.share, ("verdict", verdict.kind))
    for flag in report.flag_details:
        add("torchtop_flag", _SEVERITY_RANK.get(flag.severity, 1), ("flag", flag.kind))
    out += event_samples(base, events, stalled_s)
    add("torchtop_dropped_steps", report.dropped)
    add("torchtop_hook_errors", report.hook_errors)
    return out


def event_samples(
    base: tuple[tuple[str, str], ...], events: EventLog | None, stalled_s: float | None
) -> list[Sample]:
    """`torchtop_events_total{kind,severity}` from an event log's counts and the stall's gauge."""
    out: list[Sample] = []
    if events is not None:
        for (kind, severity), n in sorted(events.counts.items()):
            labels = (*base, ("kind", kind), ("severity", severity))
            out.append(Sample("torchtop_events", float(n), labels, "counter"))
    if stalled_s is not None:
        out.append(Sample("torchtop_stalled_seconds", float(stalled_s), base, "gauge"))
    return out


def _known(value: float | None) -> float | None:
    return value if value is not None and value >= 0 else None


class SampleBoard:
    """The latest samples, replaced whole by the exporter's loop and read by scrapes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._samples: list[Sample] = []

    def publish(self, samples: list[Sample]) -> None:
        with self._lock:
            self._samples = samples

    def read(self) -> list[Sample]:
        with self._lock:
            return self._samples
