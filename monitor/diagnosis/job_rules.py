"""The job-scope rules in the catalogue's shape, `(JobFacts, scale) -> Finding | None`: the
straggler, a host-bound job, the pipeline bubble, the job-wide collective wait and "no clear
bottleneck", over every rank's figures (straggler.py, job_model.py, bubble.py)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from statistics import median

from torchtop.monitor.diagnosis.bubble import bubble_line
from torchtop.monitor.diagnosis.facts import THRESHOLDS as T
from torchtop.monitor.diagnosis.facts import Finding
from torchtop.monitor.diagnosis.job_model import (
    HostBound,
    HostSide,
    Seconds,
    confidence,
    find_host_bound,
    measure_noise,
    own_points,
    what_if,
)
from torchtop.monitor.diagnosis.straggler import Straggler, find_straggler, straggler_finding
from torchtop.monitor.diagnosis.straggler import rule_communication as _communication
from torchtop.monitor.model.fmt import pct
from torchtop.monitor.model.rank_stats import RankTimes


@dataclass(frozen=True)
class JobFacts:
    """What the job rules look at: each running rank's figures over the same window, and the
    verdict of the job's aggregate steps (the mean rank)."""

    times: dict[int, RankTimes]
    base_kind: str
    bubble: dict[int, float] = field(default_factory=dict[int, float])  # pipeline ranks' bubble, ms a step
    seconds: Seconds = field(default_factory=dict[int, list[tuple[int, RankTimes]]])  # per-second figures
    hosts: dict[int, HostSide] = field(default_factory=dict[int, HostSide])  # ranks' host and GPU (Facts)
    gpu: bool = False  # the job runs on GPUs
    base_share: float = 1.0  # the aggregate verdict's share (`compute`: forward+backward+optimizer)
    judged: dict[float, Straggler | None] = field(default_factory=dict[float, "Straggler | None"], repr=False)

    @property
    def step_ms(self) -> float:
        """The median rank's step time (0: no rank)."""
        steps = sorted(t.step_ms for t in self.times.values())
        return steps[len(steps) // 2] if steps else 0.0

    def host_bound(self, scale: float = 1.0) -> HostBound | None:
        return find_host_bound(self.times, self.hosts, scale)

    def straggler(self, scale: float = 1.0) -> Straggler | None:
        """The job model's straggler: on host figures only where the job is (near) host-bound,
        whose GPU spans hold their wait for each launch."""
        if scale not in self.judged:  # the straggler and work-imbalance rules ask alike: judged once
            host = self.host_bound(T.hysteresis) is not None
            found = find_straggler(self.times, scale, bool(self.bubble), self.seconds, host, self.gpu)
            self.judged[scale] = found
        return self.judged[scale]


def rule_straggler(j: JobFacts, scale: float = 1.0) -> Finding | None:
    """A rank slower at the same work (its GPU or its host)."""
    found = j.straggler(scale)
    return straggler_finding(found) if found is not None and not found.imbalance else None


def rule_work_imbalance(j: JobFacts, scale: float = 1.0) -> Finding | None:
    """A rank given more work a step than the others (uneven packing, a heavier batch)."""
    found = j.straggler(scale)
    return straggler_finding(found) if found is not None and found.imbalance else None


def rule_host_bound(j: JobFacts, scale: float = 1.0) -> Finding | None:
    """Every rank's host busy about the whole step while the GPUs idle (no host straggler:
    that is found first): Python sets the pace, on every rank alike."""
    hb = j.host_bound(scale)
    if hb is None:
        return None
    gpu_hi = hb.gpu[1]
    severity = "critical" if gpu_hi < T.gpu_util_very_low / 100.0 else "warning"
    step = j.step_ms
    judged = {r: t for r, t in j.times.items() if t.steps >= T.min_steps}
    noise = measure_noise(own_points(j.seconds, judged, True), -1, step)
    evidence = (
        f"every rank's host is busy {_span(hb.host)} of its step (its phases less its collective wait "
        f"and its wait on the GPU): the host sets the pace on all {hb.ranks} ranks",
        f"their GPUs compute {_span(hb.gpu)} of the step ({hb.source}); their kernel spans hold the "
        "wait for each launch, so they are not compared",
        *((f"host hot spot: {hb.hot}",) if hb.hot else ()),
        confidence(noise, hb.host[0] >= 0.9 and hb.gpu[1] < T.gpu_util_very_low / 100.0),
    )
    advice = (
        "torch.compile(model) fuses the many small kernels; mode='reduce-overhead' adds CUDA graphs: "
        "far fewer launches",
        "fewer, larger units of work: a larger batch or width, larger FSDP units (fully_shard per "
        "group of blocks), foreach/fused optimizers and clip_grad_norm_(foreach=True)",
        "per-step host work (logging, metrics, .item()) every N steps",
    )
    # balancing the ranks buys nothing: the what-if keeps the busiest host's own time
    upside = what_if("balancing the ranks", step, step * min(1.0, hb.host[1]), noise.band_ms)
    return Finding("host-bound", severity, 1.0 - gpu_hi, evidence, advice, upside)


def _span(x: tuple[float, float]) -> str:
    lo, hi = round(x[0] * 100), round(x[1] * 100)
    return f"{lo}%" if lo == hi else f"{lo}-{hi}%"


def rule_no_bottleneck(j: JobFacts, scale: float = 1.0) -> Finding | None:
    """Nothing stands out: no rank above the noise band, no collective, bubble or host wait past
    its band, and the aggregate's `compute` under half the step. The honest answer is a verdict."""
    judged = {r: t for r, t in j.times.items() if t.steps >= T.min_steps}
    step = j.step_ms
    if j.base_kind != "compute" or len(judged) < 2 or step <= 0 or j.base_share >= T.gpu_busy / scale:
        return None
    own = {r: t.busy_ms for r, t in judged.items()}
    noise = measure_noise(own_points(j.seconds, judged, False), -1, step)
    spread = max(own.values()) - min(own.values())
    floor = min(t.comm_ms for t in judged.values())
    data = median(t.phases.get("data", 0.0) for t in judged.values())
    compute = median(sum(t.cost(p) for p in ("forward", "backward", "optimizer")) for t in judged.values())
    evidence = (
        f"no rank stands out: their own time a step is within {spread:.1f} ms of each other "
        f"({noise.band_ms:.1f} ms noise band)",
        f"forward+backward+optimizer {pct(compute / step, 0)}, collectives {pct(floor / step, 0)}, data wait "
        f"{pct(data / step, 0)} of the {step:.1f} ms step: none past its band",
        confidence(noise, spread <= noise.band_ms),
    )
    advice = ("the step is spread over many small costs: a profile (p) shows which of them to cut first",)
    return Finding("no-bottleneck", "ok", j.base_share, evidence, advice, None)


def rule_pipeline_bubble(j: JobFacts, scale: float = 1.0) -> Finding | None:
    """Every pipeline stage idles a real share of its step waiting for its neighbours (no stage
    slower than the others: that is the straggler, found first): the schedule's fill and drain."""
    shares = {
        r: b / j.times[r].step_ms for r, b in j.bubble.items() if r in j.times and j.times[r].step_ms > 0
    }
    if len(shares) < 2:
        return None
    least = min(shares, key=lambda r: shares[r])
    share = shares[least]
    if share < T.input_moderate * scale:
        return None
    severity = "critical" if share >= T.input_severe else "warning" if share >= T.input_high else "info"
    worst = max(shares, key=lambda r: shares[r])
    evidence = (
        f"every pipeline stage waits at least {pct(share, 0)} of its step for its neighbour stages' send/recv",
        bubble_line(worst, j.bubble[worst], j.times[worst].step_ms),
    )
    advice = (
        "more micro-batches a step (n_microbatches) shrink the fill and drain: the bubble is about "
        "(stages - 1) / (micro-batches + stages - 1) of a GPipe or 1F1B step",
        "an interleaved or zero-bubble schedule (ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble)",
    )
    return Finding("pipeline-bubble", severity, share, evidence, advice, None)


def rule_communication(j: JobFacts, scale: float = 1.0) -> Finding | None:
    """Only over a healthy aggregate: a data-loading job is that, not its collectives; a
    pipeline's wait for its neighbour stages is its bubble, not collective wait."""
    if j.base_kind not in ("compute", "unknown"):
        return None
    found = _communication(j.times, j.step_ms, scale, j.bubble)
    if found is None:
        return None
    judged = {r: t for r, t in j.times.items() if t.steps >= T.min_steps}
    noise = measure_noise(own_points(j.seconds, judged, False), -1, j.step_ms)
    clear = found.share * j.step_ms >= 2 * noise.band_ms  # the least wait, well past the band
    return replace(found, evidence=(*found.evidence, confidence(noise, clear)))
