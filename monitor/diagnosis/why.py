"""Where in the code, and is the GPU doing useful work: rules over stack samples, sync windows, MFU.

- `sync` (verdict from 20% of the step, flag from 5%): stack samples that found the training
  thread blocked at a call a sync window saw synchronise the device (`.item()`, `.cpu()`,
  `print(tensor)`, `nonzero()`), named with its file:line; the wait a step is the share of the
  samples × the step time (an estimate).
- `host-code` (verdict from 20%): `other` (time outside data/h2d/forward/backward/optimizer) not
  blocked on the device, with the user's frames the samples found there. It names where the time
  goes when the time outside the measured phases dominates.
- `low-mfu` (flag, CUDA): NVML says the GPU is busy, the model's FLOPs run far below its peak.
The host-overhead and compute verdicts get the hot frames and the MFU as evidence (`refine`).
Pure: Facts in, Findings out; thresholds in facts.THRESHOLDS.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, NamedTuple

from msgspec import UNSET

from torchtop.monitor.diagnosis.facts import SEVERITY_RANK, Facts, Finding
from torchtop.monitor.diagnosis.facts import THRESHOLDS as T
from torchtop.monitor.diagnosis.gpm import GpmFigures
from torchtop.monitor.diagnosis.gpm import figures as gpm_figures
from torchtop.monitor.diagnosis.report_types import (
    HotSite,
    StackSamples,
    SyncSection,
    SyncSiteReport,
    ThroughputReport,
)
from torchtop.monitor.diagnosis.throughput import FROM_COUNTERS, Throughput, mfu_line, throughput
from torchtop.monitor.model.fmt import pct
from torchtop.monitor.model.hotspots import Fold, FunctionShare, SiteShare, fold, short_callee, short_site

if TYPE_CHECKING:
    from torchtop.contract.wire import SyncInfo, SyncSite
    from torchtop.monitor.model.state import RunState
    from torchtop.monitor.model.steps import StepRecord

COMPUTE_PHASES = ("forward", "backward", "optimizer")


@dataclass
class WhyFacts:
    fold: Fold = field(default_factory=Fold)
    sync: SyncInfo | None = None
    stack_hz: float = 0.0
    throughput: Throughput = field(default_factory=Throughput)

    @property
    def enough(self) -> bool:
        return self.fold.samples >= T.min_stack_samples


def gpm_of(state: RunState) -> GpmFigures | None:
    """The first GPU's counters in the latest sample, where GPM gave any."""
    tel = state.telemetry
    return gpm_figures(tel.gpus[0]) if tel is not None and tel.gpus else None


def why_facts(state: RunState, steps: list[StepRecord], gpu_util: float | None) -> WhyFacts:
    w = state.why
    name = state.hello.device_name if state.hello else ""
    return WhyFacts(
        fold=fold(w.samples, steps),
        sync=w.sync,
        stack_hz=w.stack_hz,
        throughput=throughput(steps, w.flops, name, gpu_util, gpm_of(state)),
    )


def site_words(s: SiteShare, joiner: str = " in ") -> str:
    """A site and its share: "71% in train.py:88 log_metrics → wandb…Run.log"."""
    callee = f" → {short_callee(s.callee)}" if s.callee else ""
    caller = f", called at {short_site(s.caller)}" if isinstance(s, FunctionShare) and s.caller else ""
    return f"{pct(s.share, 0)}{joiner}{short_site(s.site) if s.site else 'no Python frame of yours'}{callee}{caller}"


def _sync_sites(w: WhyFacts) -> list[tuple[SyncSite | None, str, float]]:
    """(the window's record of the site, the site, its share of all samples), most first."""
    known = {s.site: s for s in (w.sync.sites if w.sync is not None else [])}
    out = [(known.get(site), site, n / w.fold.samples) for site, n in w.fold.sync_by_site.items()]
    return sorted(out, key=lambda x: -x[2])


def _call(s: SyncSite | None) -> str:
    if s is None:
        return "a synchronising call"
    if s.call:
        return f"`{s.call}`"
    return f"`{s.line}`" if s.line else "a synchronising call"


def sync_evidence(f: Facts) -> tuple[float, list[str], list[str]]:
    """(share of the step blocked on the device, evidence, advice)."""
    w = f.why
    if w is None or not w.enough or not w.fold.sync:
        return 0.0, [], []
    share = w.fold.sync_share()
    evidence: list[str] = []
    calls: set[str] = set()
    for rec, site, s_share in _sync_sites(w)[:3]:
        per_call = ""
        if rec is not None and rec.steps:
            per_call = f"; {rec.calls / rec.steps:.1f} calls a step"
        via = f" (inside {short_callee(rec.via)})" if rec is not None and rec.via else ""
        evidence.append(
            f"{_call(rec)} at {short_site(site)}{via} waits ~{s_share * f.step_ms:.1f} ms a step for the GPU "
            f"({pct(s_share, 0)} of the step{per_call})"
        )
        calls.add(rec.call if rec is not None else "")
    t = w.throughput
    if t.device_busy_ms is not None and t.device_step_ms is not None:
        idle = max(0.0, t.device_step_ms - t.device_busy_ms)
        evidence.append(
            f"the GPU then idles ~{idle:.1f} ms a step while Python runs (CUDA events: busy "
            f"{t.device_busy_ms:.1f} of {t.device_step_ms:.1f} ms)"
        )
    advice = [
        "log every N steps, or keep the value on the device (sum losses in a tensor, read it every N steps)"
    ]
    if calls & {"[...]", "nonzero()", ".nonzero()"}:
        advice.append(
            "boolean masks and nonzero() need a count on the host: torch.where or fixed-shape masked ops"
        )
    advice.append("copy what you need to pinned memory with non_blocking=True and read it a step later")
    return share, evidence, advice


def device_busy_ms(f: Facts) -> tuple[float | None, str]:
    """The GPU's own work a step, at most: (ms, where from). CUDA events give the span of the
    phases on the device, which on a launch-bound loop runs as long as the host (kernels trickle
    in as they are launched); NVML's busy share can be lower. The smaller is taken."""
    t = f.why.throughput if f.why is not None else None
    found: list[tuple[float, str]] = []
    if t is not None and t.device_busy_ms is not None and t.device_step_ms:
        found.append((min(1.0, t.device_busy_ms / t.device_step_ms) * f.step_ms, "CUDA events"))
    if f.gpu_util is not None and f.device == "cuda":
        found.append((f.gpu_util / 100.0 * f.step_ms, "NVML"))
    return min(found) if found else (None, "")


def gpu_bound(f: Facts) -> bool:
    """The GPU's kernels fill the step (CUDA events and NVML): a host that waits for them costs
    nothing the GPU could have done, so the wait is not the bottleneck."""
    busy, _ = device_busy_ms(f)
    return busy is not None and f.step_ms > 0 and busy >= T.gpu_bound_busy * f.step_ms


def rule_sync(f: Facts, scale: float = 1.0) -> Finding | None:
    """The verdict: the step waits on the device at a call of the user's, and the GPU idles."""
    share, evidence, advice = sync_evidence(f)
    if share < T.input_high * scale or gpu_bound(f):
        return None
    severity = "critical" if share >= T.input_severe else "warning"
    return Finding("sync", severity, share, tuple(evidence), tuple(advice))


def flag_sync(f: Facts, scale: float = 1.0) -> Finding | None:
    """The same below the verdict's threshold: a flag from 5% of the step."""
    share, evidence, advice = sync_evidence(f)
    if share < T.sync_flag or (share >= T.input_high and not gpu_bound(f)):
        return None
    return Finding("sync", "info", share, tuple(evidence), tuple(advice))


def host_code_share(f: Facts) -> tuple[float, Sequence[SiteShare]]:
    """(share of the step in `other` not blocked on the device, the sites the samples found there)."""
    w = f.why
    other = f.shares.get("other", 0.0)
    if w is None or not w.enough:
        return 0.0, []
    n = w.fold.by_phase.get("other", 0)
    if n < T.min_phase_samples:
        return 0.0, []
    # the loop's input generator's samples are data wait (facts() moves them there)
    host = other * (n - w.fold.sync_by_phase.get("other", 0) - w.fold.inputs) / n
    # by function (its lines and comprehensions summed), where one holds more than a line does
    funcs, sites = w.fold.functions.get("other", []), w.fold.host_sites.get("other", [])
    return host, funcs if funcs and (not sites or funcs[0].share >= sites[0].share) else sites


def rule_host_code(f: Facts, scale: float = 1.0) -> Finding | None:
    """The verdict: user code between the phases holds the step back, and where it is."""
    share, sites = host_code_share(f)
    if share < T.input_high * scale or not sites:
        return None
    severity = "critical" if share >= T.input_severe else "warning"
    other = f.shares.get("other", 0.0)
    evidence = [
        f"outside data/h2d/forward/backward/optimizer: {pct(other, 0)} of the step "
        f"({f.ms.get('other', 0.0):.1f} of {f.step_ms:.1f} ms)"
    ]
    evidence += [f"{site_words(s)} (of the stack samples there)" for s in sites[:2] if s.share >= 0.05]
    advice = (
        f"make {short_site(sites[0].site)} cheaper, run it every N steps, or hand it to another thread",
        "logging and metrics: aggregate on the device and log every N steps",
        "if it prepares the input (a plain generator), wrap it: for b in torchtop.agent.data(gen) times it as data",
    )
    return Finding("host-code", severity, share, tuple(evidence), advice)


def flag_low_mfu(f: Facts, scale: float = 1.0) -> Finding | None:
    """NVML says busy; the FLOPs say little useful work: small kernels, or memory-bound ones."""
    w = f.why
    if w is None or f.device != "cuda":
        return None
    t = w.throughput
    if t.mfu is None or t.gpu_util is None or t.mfu >= T.mfu_low or t.gpu_util < T.util_busy:
        return None
    if t.mfu_from == FROM_COUNTERS:
        at = f"its tensor cores do {pct(t.mfu, 0)} of their peak work ({mfu_line(t)})"
    else:
        at = (
            f"the model's FLOPs run at {pct(t.mfu, 0)} of its peak (MFU: {t.achieved_tflops or 0:.1f} of "
            f"{t.peak_tflops or 0:.0f} TFLOP/s, {t.peak_from})"
        )
    evidence = [f"NVML: the GPU is busy {t.gpu_util:.0f}% of the time, yet {at}"]
    evidence.append("NVML counts the time a kernel runs, not how much of the GPU it uses")
    if t.device_busy is not None:
        evidence.append(f"CUDA events: kernels run through {pct(t.device_busy, 0)} of the step")
    advice = [
        "larger batches: more work per kernel",
        "torch.compile (mode='reduce-overhead' adds CUDA graphs) fuses and batches small kernels",
    ]
    if t.precision in ("fp32", "tf32"):
        advice.append("bf16 autocast: torch.autocast('cuda', dtype=torch.bfloat16)")
    return Finding("low-mfu", "warning", t.mfu, tuple(evidence), tuple(advice))


#: Verdicts that say time outside the measured phases dominates without saying where (the
#: `outside-phases` verdict of issue 18): host-code takes their place once samples say where.
OUTSIDE_KINDS = ("outside-phases",)


def refine(verdict: Finding, f: Facts) -> Finding:
    """The hot frames and the MFU as evidence of the verdicts that do not name code themselves;
    a verdict that time outside the phases dominates becomes host-code where samples say where."""
    w = f.why
    if w is None:
        return verdict
    if verdict.kind in OUTSIDE_KINDS:
        host = rule_host_code(f, 0.0)
        if host is not None:
            severity = max(verdict.severity, host.severity, key=SEVERITY_RANK.__getitem__)
            notes = tuple(e for e in verdict.evidence[1:] if e not in host.evidence)
            return replace(host, severity=severity, evidence=(*host.evidence, *notes))
        return verdict
    extra: list[str] = []
    if verdict.kind == "host-overhead" and w.enough:  # on the host side of a launch-bound step
        phase = max(COMPUTE_PHASES, key=lambda p: f.ms.get(p, 0.0))
        sites = w.fold.host_sites.get(phase, [])
        if sites and w.fold.by_phase.get(phase, 0) >= T.min_phase_samples:
            extra.append(f"host time in {phase}: {site_words(sites[0])}")
    t = w.throughput
    line = mfu_line(t)
    if verdict.kind in ("compute", "host-overhead") and line is not None:
        extra.append(line)
    if not extra:
        return verdict
    return replace(verdict, evidence=(*verdict.evidence, *extra))


class WhySections(NamedTuple):
    """The report's `sync`, `stack_samples`, `hot_frames`, `hot_functions` and `throughput`."""

    sync: SyncSection
    stack_samples: StackSamples
    hot_frames: dict[str, list[HotSite]]
    hot_functions: dict[str, list[HotSite]]
    throughput: ThroughputReport


def hot_site(s: SiteShare) -> HotSite:
    caller = s.caller if isinstance(s, FunctionShare) else UNSET
    return HotSite(s.site, s.callee, s.samples, round(s.share, 4), caller)


def why_report(state: RunState, steps: list[StepRecord], w: WhyFacts) -> WhySections:
    """The report's `sync`, `hot_frames`, `stack_samples` and `throughput` sections: `w`, the
    window's one fold of the stack samples over `steps`."""
    fo = w.fold
    step_ms = w.throughput.step_ms
    sync = SyncSection(state=w.sync.state if w.sync else "unknown")
    if w.sync is not None:
        sync.reason = w.sync.reason or None
        sync.windows = w.sync.windows
        sync.cost_us_per_sync = w.sync.cost_us
        sync.sites = [
            SyncSiteReport(
                site=s.site,
                call=s.call or None,
                via=s.via or None,
                line=s.line or None,
                calls_per_step=round(s.calls / s.steps, 3) if s.steps else None,
                wait_ms_per_step=round(fo.sync_share(s.site) * step_ms, 3) if fo.samples else None,
                share=round(fo.sync_share(s.site), 4) if fo.samples else None,
            )
            for s in w.sync.sites
        ]
    sync.share = round(fo.sync_share(), 4) if fo.samples else None
    sync.wait_ms_per_step = round(fo.sync_share() * step_ms, 3) if fo.samples else None
    return WhySections(
        sync=sync,
        stack_samples=StackSamples(
            hz=w.stack_hz,
            in_steps=fo.samples,
            late=fo.late,
            by_phase=dict(fo.by_phase),
            cost_us=round(state.why.stack_cost_us, 2) if state.why.stack_cost_us is not None else None,
        ),
        hot_frames={phase: [hot_site(s) for s in sites] for phase, sites in fo.sites.items()},
        # the same by function of the user's (lines and comprehensions summed), with its caller
        hot_functions={phase: [hot_site(s) for s in fns] for phase, fns in fo.functions.items()},
        throughput=w.throughput.to_report(),
    )
