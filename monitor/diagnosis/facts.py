"""What the diagnosis rules look at and what they say: thresholds, facts, findings.

Every threshold is in THRESHOLDS (and in the README); the rules (verdicts.py, flags.py) are pure
functions of `Facts`, so each is tested at its thresholds without sockets or a UI.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import msgspec

from torchtop.monitor.diagnosis.report_types import FindingReport

if TYPE_CHECKING:
    from torchtop.monitor.diagnosis.checkpoint import Saving
    from torchtop.monitor.diagnosis.gpm import GpmFigures
    from torchtop.monitor.diagnosis.oom import OomForecast
    from torchtop.monitor.diagnosis.stall import Stall
    from torchtop.monitor.diagnosis.upside import Upside
    from torchtop.monitor.diagnosis.why import WhyFacts


@dataclass(frozen=True)
class Thresholds:
    """Every threshold of the diagnosis (README, docs/verdicts.md): `THRESHOLDS.input_high`."""

    warmup_steps: float = 10  # first steps of a run are not judged (compilation, allocator warm-up)
    min_steps: float = 5  # fewer judged steps than this: verdict `unknown`
    # ... but slow steps are judged early (warmup.py): once this many steps are seen, or they span
    # this long, all but the first one or two, the verdict saying its confidence
    early_steps: float = 10
    early_s: float = 20.0
    window_s: float = 10.0  # judge the last 10 s or the last 50 steps, whichever holds more steps
    window_steps: float = 50
    # data wait / transfer share of step time. Under `input_high` it is a note under a healthy
    # (compute) headline, not a bottleneck: a person would not rebuild a pipeline for 7%
    input_moderate: float = 0.05  # a note
    input_high: float = 0.20  # the verdict: warning
    input_severe: float = 0.50  # critical
    # time outside the measured phases (`other`): the verdict once it is at least this share and
    # more than forward+backward+optimizer (so compute never heads a step it is < 30% of) ...
    outside_high: float = 0.30  # warning
    outside_severe: float = 0.60  # critical
    # ... unless the GPU is busy: then the host waits on it there (a .item(), a sync): compute.
    # Busy: CUDA-event forward+backward+optimizer >= this share of the step, or NVML >= gpu_util_low
    gpu_busy: float = 0.50
    hysteresis: float = 0.8  # the verdict in force keeps its thresholds scaled by this
    gpu_util_low: float = 50.0  # percent (NVML): below it, with the host busy, the GPU waits on Python
    gpu_util_very_low: float = 25.0  # critical
    memory_high: float = 0.90  # reserved or window peak / device total: warning
    memory_critical: float = 0.97
    frag_external: float = 0.5  # 1 - largest free block / free inside segments
    frag_free_share: float = 0.2  # ... with at least this share of reserved memory free but split
    frag_free_min_bytes: float = 256 * 2**20
    frag_reserved_ratio: float = 2.0  # reserved >= 2x allocated ...
    frag_reserved_device: float = 0.3  # ... while reserved >= 30% of the device
    # DataLoader workers are the limit when data wait >= input_high and they are busy this share
    # of the time: CPU plus the time they waited for a CPU (Linux run-queue delay), so a worker
    # that never rests reads ~100% on a busy machine too (psutil's CPU alone read 55-81% there)
    worker_saturated: float = 75.0
    worker_cpu_starved: float = 25.0  # workers waiting this much for a CPU: the cores are taken
    # a worker hands each batch over through shared memory and a pipe, which costs the training
    # process a few tenths of a ms: below this much loading a step more workers win little
    workers_min_ms: float = 1.0
    # memory in use between steps: the per-second low points of allocated CUDA memory, or of the
    # RSS (read at 10 Hz; the agent keeps ten minutes of lows for monitors that join later),
    # against the agent's step count (growth.py)
    leak_horizon_s: float = 60.0  # judged over the last minute ...
    leak_warmup_steps: float = 50  # ... past the run's first 50 steps (caches, allocator arenas fill) ...
    leak_min_span_s: float = 20.0  # ... spanning at least 20 s ...
    leak_min_steps: float = 50  # ... and 50 steps: RSS on CPU rises for tens of steps and settles
    leak_min_points: float = 10
    leak_trend: float = 0.6  # Kendall's tau of the points: most pairs later-higher (noise gives ~0),
    leak_still: float = 0.5  # the last third of the points rises at >= half the span's rate ...
    leak_seen: float = 0.05  # the fitted (Theil-Sen) growth over the span is >= 5% of the level ...
    leak_growth: float = 0.10  # ... and at that rate it adds >= 10% of the level every leak_steps
    leak_steps: float = 1000
    # oom.py: a steady rise (the leak's trend tests) forecast to reach the memory limit within
    # this long is a warning flag of its own: time to snapshot or checkpoint before the crash ...
    oom_warning_s: float = 1800.0
    oom_critical_s: float = 300.0  # ... critical: minutes left
    # the forecast's confidence: Kendall's tau and the seconds of lows behind it (the leak
    # horizon is a minute; a 20 s rise at tau 0.7 may still be caches filling)
    oom_high_tau: float = 0.9
    oom_high_s: float = 45.0
    oom_moderate_tau: float = 0.75
    oom_moderate_s: float = 30.0
    # a job's straggler (straggler.py): the other ranks' median extra collective wait a step,
    # as a share of the step (TraceML's straggler score bands: 0.10 warning, 0.20 critical)
    straggler_info: float = 0.05
    straggler_warning: float = 0.10
    straggler_critical: float = 0.20
    straggler_min_ms: float = 0.2  # ... and at least this long (sub-ms jitter on fast steps is noise)
    # ... of a pipeline's stages: split by whole layers, and the last one also runs the loss, so
    # stages within this share are as balanced as a partition gets (its bubble is the verdict)
    straggler_pipeline: float = 0.10
    straggler_explained: float = 0.3
    # the job model (job_model.py): a straggler's own work must exceed the others' median by
    # more than the job's noise band (the ranks' own work, second to second over the window,
    # measured once `noise_seconds` seconds hold steps; else 5% of the step), be the slowest
    # in this share of those seconds, and its measured phases' excess explain this share of
    # the others' wait
    noise_seconds: float = 3
    # the band is one standard deviation of a rank's own time second to second: its window mean
    # must clear twice that (identical ranks on a loaded 2-core VM drifted 1.2 ms apart for a
    # window with a 0.6-1 ms band; planted stragglers clear it 4-100x)
    straggler_margin: float = 2.0
    straggler_persistent: float = 0.6
    straggler_covered: float = 0.5
    # the straggler's training thread waited for a CPU this percent of the window (Linux run-queue
    # delay) and twice the other ranks' median: its host is oversubscribed, said with the verdict
    cpu_starved: float = 20.0
    # every rank's host busy this share of its step (its phases less its collective and GPU
    # waits) while no GPU computes `gpu_busy` of it: the job is host-bound
    host_bound: float = 0.85
    speedup_cap: float = 10.0  # a what-if beyond this is "over 10x": 10 s means do not say more
    slowdown_shown: float = 1.1  # a slowdown under this is not said
    # the straggler's work a step (tokens, else samples) vs the median other rank's: at or above
    # this ratio it is given more work (uneven packing), within `work_same` it is slower at the same
    work_imbalance: float = 1.25
    work_same: float = 0.10  # its slowest phase's excess explains at least this share of the wait
    # why.py: stack samples and sync windows (docs/why.md)
    min_stack_samples: float = 20  # fewer samples in the judged steps: no sync or host-code finding
    min_phase_samples: float = 8  # fewer in a phase: its sites are not named
    gpu_bound_busy: float = 0.90  # kernels fill this share of the device step: waiting on them is no stall
    sync_flag: float = 0.05  # time blocked on the device, share of the step: a flag (info) ...
    # ... and a verdict from input_high (warning) and input_severe (critical); so is host-code:
    # time in user code outside the measured phases, not blocked on the device
    mfu_disagree: float = 0.10  # counter-based and FLOP-based MFU this far apart: mfu-disagree (info)
    mfu_low: float = 0.10  # MFU under this ...
    util_busy: float = 80.0  # ... while NVML says the GPU is busy at least this: low-mfu (warning)
    # stall.py: no step end for this many median steps and at least this long is a stall (a
    # checkpoint or an epoch's eval can take a few steps' time; the issue's deadline is 15 s) ...
    stall_steps: float = 5.0
    stall_min_s: float = 5.0
    stall_said_s: float = 60.0  # ... and one that ended this recently is said as resumed
    # checkpoint.py: saves' share of wall time over the judged steps (timed or not)
    checkpoint_high: float = 0.10  # warning: a tenth of the run spent saving
    checkpoint_severe: float = 0.30  # critical
    # ... the steps after each save (up to this many, half the way to the next) against those
    # further from one: slower by more than `checkpoint_after_bands` noise bands (the gap-to-gap
    # spread of the far steps' median), after most saves, is the save's cost too (async staging)
    checkpoint_after_steps: float = 5
    checkpoint_after_bands: float = 2.0


THRESHOLDS = Thresholds()
T = THRESHOLDS
Severity = Literal["ok", "info", "warning", "critical"]
SEVERITY_RANK: dict[Severity, int] = {"ok": 0, "info": 1, "warning": 2, "critical": 3}


class Growth(NamedTuple):
    """The trend of memory in use between steps (per-second low points against the step count),
    robust to noise: growth.py."""

    first: float  # fitted level at the start of the span, bytes
    last: float  # ... and at its end
    span_s: float
    trend: float  # Kendall's tau: +1 every later point higher, ~0 noise
    slope: float  # bytes a training step, Theil-Sen (the median of the pairwise slopes)
    points: int
    recent_slope: float = 0.0  # the same over the last third of the points: still rising?
    span_steps: float = 0.0  # training steps between the first and the last point


def worker_busy(cpu: float | None, wait: float | None) -> float | None:
    """A worker's busy percent: on a CPU, or runnable and waiting for one (when known)."""
    if cpu is None:
        return None
    return cpu + wait if wait is not None else cpu


@dataclass(frozen=True)
class Finding:
    kind: str
    severity: Severity
    share: float
    evidence: tuple[str, ...] = ()
    advice: tuple[str, ...] = ()
    upside: Upside | None = None  # what fixing it would buy (upside.py)

    def to_report(self) -> FindingReport:
        return FindingReport(
            kind=self.kind,
            severity=self.severity,
            share=round(self.share, 4),
            evidence=list(self.evidence),
            advice=list(self.advice),
            upside=self.upside.to_report() if self.upside is not None else None,
        )

    def to_json(self) -> dict[str, Any]:
        return msgspec.to_builtins(self.to_report())


@dataclass(frozen=True)
class Diagnosis:
    verdict: Finding
    flags: tuple[Finding, ...] = ()
    steps: int = 0
    step_ms: float = 0.0  # the judged steps' mean: the step time the verdict's figures are of
    oom: OomForecast | None = None  # when memory in use reaches its limit (oom.py); None: no steady rise
    ranks: int = 1  # the ranks whose steps `steps` pools (a job's verdict)
    inference: bool = False  # `steps` are forward passes (an eval or serving loop's)

    def to_json(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict.to_json(),
            "flags": [f.kind for f in self.flags],
            "flag_details": [f.to_json() for f in self.flags],
        }


@dataclass
class Facts:
    """Everything the rules look at, reduced from the state (tests build it directly)."""

    steps: int
    step_ms: float
    shares: dict[str, float]
    ms: dict[str, float]
    device: str = "cpu"
    device_ms: dict[str, float] = field(default_factory=dict[str, float])
    inference: bool = False  # the steps are forward passes (an eval or serving loop), not training steps
    # None: not known (no NVML, no host sample yet, no run-queue figures)
    gpu_util: float | None = None  # mean NVML utilisation over the window
    gpm: GpmFigures | None = None  # the GPU's own counters (GPM, Hopper+): monitor/diagnosis/gpm.py
    proc_cpu: float | None = None  # mean training-process CPU percent
    cores: int = 0
    workers: int | None = None  # DataLoader worker processes
    worker_cpu: float | None = None  # their mean CPU percent
    worker_wait: float | None = None  # their mean percent of time waiting for a CPU
    mem_total: int = 0
    reserved: int = 0
    allocated: int = 0
    window_peak: int = 0
    inactive_split: int = 0
    retry_rate: float = 0.0
    ooms: int = 0
    frag_external: float = 0.0
    frag_free: int = 0
    expandable: bool = False
    growth: Growth | None = None
    growth_what: str = "allocated"
    oom: OomForecast | None = None  # when the growth reaches the memory limit (oom.py)
    why: WhyFacts | None = None  # stack samples, sync windows, throughput and MFU (why.py)
    input_wait: float = 0.0  # share of the step resuming the loop's input generator (in `data`)
    stall: Stall | None = None  # no step end for a while, or one that ended recently (stall.py)
    checkpoint: Saving | None = None  # the judged steps' saves (checkpoint.py); None: none seen
