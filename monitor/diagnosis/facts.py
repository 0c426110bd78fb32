"""What the diagnosis rules look at and what they say: thresholds, facts, findings.

Every threshold is in THRESHOLDS (and in the README); the rules (verdicts.py, flags.py) are pure
functions of `Facts`, so each is tested at its thresholds without sockets or a UI.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from torchtop.monitor.diagnosis.upside import Upside
    from torchtop.monitor.diagnosis.why import WhyFacts

THRESHOLDS: dict[str, float] = {
    "warmup_steps": 10,  # first steps of a run are not judged (compilation, allocator warm-up)
    "min_steps": 5,  # fewer judged steps than this: verdict `unknown`
    "window_s": 10.0,  # judge the last 10 s or the last 50 steps, whichever holds more steps
    "window_steps": 50,
    "input_moderate": 0.05,  # data wait / transfer share of step time: info
    "input_high": 0.20,  # warning
    "input_severe": 0.50,  # critical
    "hysteresis": 0.8,  # the verdict in force keeps its thresholds scaled by this
    "gpu_util_low": 50.0,  # percent (NVML): below it, with the host busy, the GPU waits on Python
    "gpu_util_very_low": 25.0,  # critical
    "memory_high": 0.90,  # reserved or window peak / device total: warning
    "memory_critical": 0.97,
    "frag_external": 0.5,  # 1 - largest free block / free inside segments
    "frag_free_share": 0.2,  # ... with at least this share of reserved memory free but split
    "frag_free_min_bytes": 256 * 2**20,
    "frag_reserved_ratio": 2.0,  # reserved >= 2x allocated ...
    "frag_reserved_device": 0.3,  # ... while reserved >= 30% of the device
    # mean CPU percent of the DataLoader workers above which they are the limit: psutil over 1 s
    # windows under-reads a busy worker on a shared machine (81% seen for one that never rested)
    "worker_saturated": 75.0,
    "leak_growth": 0.10,  # memory grew >= 10% over the leak horizon ...
    "leak_min_span_s": 10.0,  # ... measured over at least this long ...
    "leak_horizon_s": 60.0,
    "leak_monotonic": 0.7,  # ... with at least 70% of the changes upward
    # a job's straggler (straggler.py): the other ranks' median extra collective wait a step,
    # as a share of the step (TraceML's straggler score bands: 0.10 warning, 0.20 critical)
    "straggler_info": 0.05,
    "straggler_warning": 0.10,
    "straggler_critical": 0.20,
    "straggler_min_ms": 0.2,  # ... and at least this long (sub-ms jitter on fast steps is noise)
    "straggler_explained": 0.3,  # its slowest phase's excess explains at least this share of the wait
    # why.py: stack samples and sync windows (docs/why.md)
    "min_stack_samples": 20,  # fewer samples in the judged steps: no sync or host-code finding
    "min_phase_samples": 8,  # fewer in a phase: its sites are not named
    "sync_flag": 0.05,  # time blocked on the device, share of the step: a flag (info) ...
    # ... and a verdict from input_high (warning) and input_severe (critical); so is host-code:
    # time in user code outside the measured phases, not blocked on the device
    "mfu_low": 0.10,  # MFU under this ...
    "util_busy": 80.0,  # ... while NVML says the GPU is busy at least this: low-mfu (warning)
}
T = THRESHOLDS
Severity = Literal["ok", "info", "warning", "critical"]
SEVERITY_RANK: dict[Severity, int] = {"ok": 0, "info": 1, "warning": 2, "critical": 3}


@dataclass(frozen=True)
class Finding:
    kind: str
    severity: Severity
    share: float
    evidence: tuple[str, ...] = ()
    advice: tuple[str, ...] = ()
    upside: Upside | None = None  # what fixing it would buy (upside.py)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "severity": self.severity,
            "share": round(self.share, 4),
            "evidence": list(self.evidence),
            "advice": list(self.advice),
            "upside": self.upside.to_json() if self.upside is not None else None,
        }


@dataclass(frozen=True)
class Diagnosis:
    verdict: Finding
    flags: tuple[Finding, ...] = ()
    steps: int = 0

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
    device_ms: dict[str, float] = field(default_factory=dict)
    # None: not known (no NVML, no host sample yet)
    gpu_util: float | None = None  # mean NVML utilisation over the window
    proc_cpu: float | None = None  # mean training-process CPU percent
    cores: int = 0
    workers: int | None = None  # DataLoader worker processes
    worker_cpu: float | None = None  # their mean CPU percent
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
    growth: tuple[float, float, float, float] | None = None  # (first, last, span_s, upward share)
    growth_what: str = "allocated"
    why: WhyFacts | None = None  # stack samples, sync windows, throughput and MFU (why.py)
