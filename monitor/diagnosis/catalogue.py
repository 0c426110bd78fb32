"""Every verdict and flag, each in one entry: its kind, scope, words, rule, upside and docs row.

The tables the rest of the code reads are views of this one: the rules the selection runs
(selection.py), the headlines and flag words of the verdict panel, the help screen's line, the
upsides, the table of docs/verdicts.md (`python -m torchtop.monitor.diagnosis.catalogue` prints
it; tests/test_catalogue.py holds the file to it). A new verdict or flag is its rule, its entry
here and its test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from torchtop.monitor.diagnosis import checkpoint, flags, gpm, stall, upside, verdicts, why
from torchtop.monitor.diagnosis.facts import Facts, Finding
from torchtop.monitor.diagnosis.job_rules import (
    JobFacts,
    rule_communication,
    rule_host_bound,
    rule_no_bottleneck,
    rule_pipeline_bubble,
    rule_straggler,
    rule_work_imbalance,
)
from torchtop.monitor.diagnosis.upside import Upside

Role = Literal["verdict", "flag"]
Scope = Literal["rank", "job"]
RankRule = Callable[[Facts, float], "Finding | None"]  # (facts, threshold scale) -> finding
JobRule = Callable[[JobFacts, float], "Finding | None"]
UpsideRule = Callable[[Facts], "Upside | None"]
#: the rule sets the upside itself (a job's figures are not a rank's Facts)
IN_RULE: Literal["in-rule"] = "in-rule"


@dataclass(frozen=True)
class Entry:
    kind: str
    role: Role
    scope: Scope
    headline: str  # the verdict panel's headline (a flag's: its words in the flag row)
    meaning: str  # what it means, in a line
    help: str  # its words in the help screen's list
    rule: RankRule | JobRule | None  # None: decided before any rule runs (`unknown`)
    upside: UpsideRule | Literal["in-rule"] | None  # None: nothing to buy (`unknown`)
    when: str  # docs/verdicts.md: raised when
    source: str = ""  # docs/verdicts.md: the public rule it starts from
    cuda: bool = False  # raised on CUDA only
    fallback: bool = False  # the verdict where no rule fires (`compute`)

    @property
    def docs_row(self) -> str:
        label = (
            f"`{self.kind}`"
            + (" (CUDA)" if self.cuda else "")
            + (" flag" if self.role == "flag" and self.kind in _BOTH else "")
        )
        if self.scope == "job":
            label += " (job)"
        return f"| {label} | {self.when} | {self.source} |".replace("|  |", "| |")


CATALOGUE: tuple[Entry, ...] = (
    Entry(
        "stalled", "verdict", "rank", "Stalled",
        "no step has ended for many times the median step: the run is stopped", "stalled",
        stall.rule_stalled, stall.stall_upside,
        "no step end for 5× the median step and at least 5 s of the agent's clock (critical, before every "
        "other verdict), with where the training thread is from its stack samples: inside a collective, or "
        "outside any at the user's frame and the call it is blocked in (a warning, not a hang, where the "
        "samples are in a checkpoint save). A job's: every rank stalled, the "
        "ranks outside any collective named first (they hold it), the others waiting in theirs; no straggler "
        "is named from it. A stall that ended in the last minute is said as resumed under the verdict",
        "hang detectors: Mycroft names the faulty rank in 15 s, Minder in 3.6 s",
    ),
    Entry(
        "data-loading", "verdict", "rank", "Data-loading bound",
        "the training thread waits on the input pipeline", "data-loading bound",
        verdicts.rule_data, upside.data_upside,
        "data wait ≥ 20% of step time (warning), ≥ 50% (critical); 5–20% is a note under the `compute` headline",
        "TensorFlow input-pipeline analysis: < 5% not input bound, 5–20% moderately, ≥ 20% highly",
    ),
    Entry(
        "transfer", "verdict", "rank", "Transfer bound",
        "host-to-device copies take a large share of each step", "transfer bound",
        verdicts.rule_transfer, upside.transfer_upside,
        "host-to-device share (host time, or CUDA copy time / device step) in the same bands",
        "same",
    ),
    Entry(
        "checkpoint", "verdict", "rank", "Checkpoint bound",
        "saving checkpoints takes a large share of wall time", "checkpoint bound",
        checkpoint.rule_checkpoint, checkpoint.checkpoint_upside,
        "saves (`torch.save`, DCP `save` / `async_save` staging and its `.result()` wait, safetensors "
        "`save_file`, Lightning's `Trainer.save_checkpoint`, HF Trainer's checkpoint and "
        "`save_pretrained`, on the training thread) ≥ 10% of wall time over the judged steps, timed or "
        "not (warning), ≥ 30% (critical); the up to 5 steps after each save (at most half the way to the "
        "next) slower than the steps far from one, by more than twice the noise band (the gap-to-gap "
        "spread of those steps' median) after most saves, are its cost too and said (async staging "
        "contending with compute); its upside the share at a 10× longer save interval, from the "
        "measured cost a save and steps between saves",
        "NVIDIA-NeMo/Automodel #3131: async checkpoint staging made steps ~10× slower",
    ),
    Entry(
        "outside-phases", "verdict", "rank", "Outside the measured phases",
        "most of each step is spent outside data/forward/backward/optimizer", "outside the measured phases",
        verdicts.rule_outside, upside.outside_upside,
        "time outside the measured phases (`other`: a generator's preprocessing, per-step host work, code no "
        "hook sees) ≥ 30% of the step and more than forward+backward+optimizer (warning; ≥ 60% critical); not "
        "on CUDA while the GPU is busy (CUDA-event forward+backward+optimizer ≥ 50% of the step, or NVML "
        "≥ 50%): the host waits on it there; `host-code` takes its place where stack samples name the code",
    ),
    Entry(
        "compute", "verdict", "rank", "Compute bound",
        "the model's own work fills the step: the healthy case", "compute bound",
        verdicts.rule_compute, upside.compute_upside,
        "none of the above: the healthy case (so forward+backward+optimizer ≥ 30% of the step, or a busy "
        "GPU), 5–20% waits as notes, with advice to go faster",
        fallback=True,
    ),
    Entry(
        "host-overhead", "verdict", "rank", "Host-overhead bound",
        "the GPU idles while Python launches kernels", "host-overhead bound",
        verdicts.rule_host_overhead, upside.host_overhead_upside,
        "NVML GPU utilisation < 50% (warning), < 25% (critical) with no data/transfer wait and no "
        "`outside-phases`",
        "PyTorch profiler plugin: GPU util < 50%",
        cuda=True,
    ),
    Entry(
        "straggler", "verdict", "job", "Straggler",
        "one rank holds every other rank back", "straggler",
        rule_straggler, IN_RULE,
        "the rank that waits least in collectives (it arrives last), when all of: its own time (the step less "
        "its collective wait; host figures only on a `host-bound` job) exceeds the others' median by more than "
        "twice the job's noise band (the median over the other ranks of their own time's standard deviation "
        "second to second over the window, at least 0.2 ms; while fewer than 3 seconds hold steps, once 5% of "
        "the step); it is "
        "ahead of the others' median by more than the band in ≥ 60% of those seconds (a spike of a few "
        "seconds is not a straggler; whether it was slower before the window too is said as its "
        "persistence, chronic or one-off); its phases' excess "
        "over the others' median explains ≥ 50% of their wait; and that wait is ≥ 5% of the step (info), "
        "10% (warning), 20% (critical). Its reason is "
        "the phase it spends most more than the others' median in, where that explains ≥ 30% of the wait; "
        "its upside the step at the slowest other rank's own time plus the collectives' own time. Where its "
        "training thread waited for a CPU ≥ 20% of the window and twice the other ranks' median (Linux "
        "run-queue delay), the second line says its host is oversubscribed and the advice starts there",
        "TraceML's straggler score bands (0.10 / 0.20)",
    ),
    Entry(
        "work-imbalance", "verdict", "job", "Work imbalance",
        "one rank is given more work a step than the others, who wait for it", "work imbalance",
        rule_work_imbalance, IN_RULE,
        "the straggler's evidence, noise band and bands, where the slow rank's tokens (else samples) a step "
        "are ≥ 1.25× the median rank's (its batch shapes, seen on timed steps); within 10% of the median it "
        "stays `straggler`, slower at the same work",
    ),
    Entry(
        "host-bound", "verdict", "job", "Host bound",
        "every rank's GPU waits for its host's Python: the host sets the pace on all ranks alike",
        "host bound",
        rule_host_bound, IN_RULE,
        "no straggler on host figures, every rank's host busy ≥ 85% of its step (its timed phases less its "
        "collective wait and its stack-sampled wait on the GPU), and every rank whose GPU is read (two at "
        "least) computing < 50% of it (GPM SM activity, else the smaller of NVML's utilisation and the "
        "CUDA-event kernel spans): warning, < 25% critical. Device spans are not compared (they hold the "
        "wait for each launch); the host hot spot is the busiest host's top stack-sampled site; its noise "
        "band is the straggler's, on host figures; its upside (balancing the ranks) no measurable gain",
    ),
    Entry(
        "pipeline-bubble", "verdict", "job", "Pipeline bubble",
        "every pipeline stage idles waiting for its neighbour stages: the schedule's fill and drain",
        "pipeline bubble",
        rule_pipeline_bubble, IN_RULE,
        "no straggler, and every pipeline stage (torch.distributed.pipelining) waits ≥ 5% of its step in "
        "the schedule's send/recv (info; 20% warning, 50% critical); a slower stage is the straggler; the "
        "least-waiting stage's share is judged, so one stage's noise cannot raise it",
        "GPipe's bubble (S-1)/(M+S-1) of the step for S stages and M micro-batches (Huang et al., 2019)",
    ),
    Entry(
        "communication", "verdict", "job", "Communication bound",
        "every rank waits in collectives its compute does not hide", "communication bound",
        rule_communication, IN_RULE,
        "no straggler, the aggregate's verdict `compute`, and every rank waits ≥ 5% of the step in "
        "collectives (info; 20% warning, 50% critical), a pipeline's send/recv wait left out; the least "
        "wait of any rank is judged (the collectives' own time: one rank's noise cannot raise it)",
    ),
    Entry(
        "no-bottleneck", "verdict", "job", "No clear bottleneck",
        "nothing stands out: no rank, wait or phase holds the step back", "no clear bottleneck",
        rule_no_bottleneck, IN_RULE,
        "none of the job verdicts above, the aggregate's verdict `compute` with forward+backward+optimizer "
        "under 50% of the step (ok); it says the spread of the ranks' own time against the noise band "
        "(the straggler's, measured second to second)",
    ),
    Entry(
        "waiting", "verdict", "job", "Waiting for a straggler",
        "this rank waits in collectives for a slower rank of its job", "waiting for a straggler",
        None, IN_RULE,
        "a rank's own line while its job has a `straggler` or `work-imbalance` that is another rank: its "
        "extra collective wait over the straggler's, a step (diagnosis/in_job.py; never `sync` or an idle GPU); "
        "it exists only under a straggler, so only past the straggler's noise band",
    ),
    Entry(
        "sync", "verdict", "rank", "Sync stalls",
        "the host waits for the GPU at a call of yours; the GPU then waits for the host", "sync stalls",
        why.rule_sync, upside.sync_upside,
        "the step blocked on the GPU at a call of yours (`.item()`, `print(tensor)`, `nonzero()`), named with "
        "its file:line: ≥ 20% of step time (warning), ≥ 50% (critical)",
        'sync windows (`set_sync_debug_mode("warn")`, 2 s a minute) find the calls, stack samples measure the '
        "wait: [docs/why.md](docs/why.md)",
        cuda=True,
    ),
    Entry(
        "host-code", "verdict", "rank", "Host-code bound",
        "your Python between the phases holds the step back", "host-code bound",
        why.rule_host_code, upside.host_code_upside,
        "`other` (outside the measured phases) not blocked on the GPU ≥ 20% of step time (warning), ≥ 50% "
        "(critical), with the user frames the stack samples found there",
        "TraceML's \"residual\", split by stack samples (~20 Hz, from torchtop's own thread)",
    ),
    Entry(
        "unknown", "verdict", "rank", "Warming up", "not judged yet", "warming up",
        None, None,
        "fewer than 5 steps judged past the first 10 (warm-up): not judged yet",
    ),
    Entry(
        "memory-pressure", "flag", "rank", "memory pressure",
        "the device's memory is nearly full, or the allocator retries", "memory pressure",
        flags.flag_memory_pressure, upside.memory_pressure_upside,
        "reserved or peak ≥ 90% of the device (≥ 97%: critical; the device is the share "
        "`set_per_process_memory_fraction` allows), allocator retries, OOMs",
        "profiler plugin: peak memory > 90%",
    ),
    Entry(
        "fragmentation", "flag", "rank", "allocator fragmentation",
        "memory sits free in the cache but cannot serve large blocks", "allocator fragmentation",
        flags.flag_fragmentation, upside.fragmentation_upside,
        "allocator retries while ≥ 10% of the cache sits free (critical); or a cache ≥ 30% of the device that "
        "is ≥ 50% externally fragmented or ≥ 2× what is allocated (warning)",
        "TraceML's reserved/allocated rule",
    ),
    Entry(
        "dataloader-workers", "flag", "rank", "DataLoader workers",
        "the loader's workers are why the step waits on data", "DataLoader workers",
        flags.flag_dataloader_workers, upside.data_upside,
        "data wait ≥ 20% and ≥ 1 ms a step, and no workers, or workers busy ≥ 75% of the time counting their "
        "wait for a CPU (Linux run-queue delay: a saturated worker on a loaded machine), or mostly idle ones "
        "(I/O)",
    ),
    Entry(
        "memory-leak", "flag", "rank", "memory keeps growing",
        "memory in use between steps rises steadily", "memory keeps growing",
        flags.flag_memory_leak, upside.memory_leak_upside,
        "per-second lows of memory in use (allocated CUDA memory, or RSS) against the step count, over the "
        "last minute past the first 50 steps, ≥ 20 s and 50 steps of them: rising steadily (Kendall's τ ≥ "
        "0.6) and still in their last third, ≥ 5% over the span, ≥ 10% every 1,000 steps at the Theil–Sen "
        "rate (bytes a step, so a pause is not settling); the agent keeps 10 minutes of lows, so a short "
        "`report` judges it too",
    ),
    Entry(
        "oom-forecast", "flag", "rank", "out of memory soon",
        "at its steady growth, memory in use reaches its limit within 30 minutes", "out of memory soon",
        flags.flag_oom_forecast, upside.memory_leak_upside,
        "the leak's trend tests (τ ≥ 0.6, ≥ 20 s and 50 steps, still rising) and, at its Theil–Sen rate and the "
        "judged step rate, the headroom to the limit (the device's or its per-process share on CUDA; on CPU "
        "the smallest of the cgroup's, RLIMIT_AS/RLIMIT_DATA and the machine's; the user's "
        "`TORCHTOP_MEMORY_LIMIT` where lower) used up in < 30 min (warning), < 5 min (critical); the "
        "forecast, with its confidence, also in the `memory-leak` evidence and `report`'s `oom_forecast`",
        "PyTorch RFC #108 (\"it made it about 40 steps in and OOM'd\"), verl #7770 (a snapshot before the OOM)",
    ),
    Entry(
        "sync", "flag", "rank", "waits on the GPU",
        "the step blocks on the GPU at a call of yours, under the verdict's bands", "waits on the GPU",
        why.flag_sync, upside.sync_upside,
        "the `sync` verdict's wait at ≥ 5% of step time (info)",
        cuda=True,
    ),
    Entry(
        "low-mfu", "flag", "rank", "busy, little useful work",
        "NVML says busy while the model's FLOPs use little of the GPU", "busy, little useful work",
        why.flag_low_mfu, upside.low_mfu_upside,
        "MFU (FLOPs a step counted once with `FlopCounterMode` ÷ step time ÷ the GPU's peak for the dtype) "
        '< 10% while NVML utilisation ≥ 80%: small or memory-bound kernels keep it "busy"',
        "MFU as torchtitan and Lightning's ThroughputMonitor; nvitop #189",
        cuda=True,
    ),
    Entry(
        "mfu-disagree", "flag", "rank", "MFU: counters and FLOPs disagree",
        "the GPU's tensor-pipe counters and the FLOP count give MFUs 10 points or more apart",
        "MFU: counters and FLOPs disagree",
        gpm.flag_mfu_disagree, IN_RULE,
        "GPM's tensor-pipe activity × SM clock ÷ its maximum (Hopper and newer) and the FLOP-based MFU ≥ 10 "
        "points apart: a FLOP count that misses or invents work, or tensor cores left idle",
        "counter-based utilisation (the OFU audit); torchtitan #4366, Megatron-LM #831",
        cuda=True,
    ),
)  # fmt: skip

_BOTH = {e.kind for e in CATALOGUE if e.role == "flag"} & {e.kind for e in CATALOGUE if e.role == "verdict"}


def entries(role: Role, scope: Scope | None = None) -> tuple[Entry, ...]:
    return tuple(e for e in CATALOGUE if e.role == role and (scope is None or e.scope == scope))


def entry(kind: str, role: Role = "verdict") -> Entry | None:
    return next((e for e in CATALOGUE if e.kind == kind and e.role == role), None)


def upside_rule(kind: str) -> UpsideRule | None:
    """The upside rule of a verdict or flag of this kind (the verdict's where both exist)."""
    e = entry(kind) or entry(kind, "flag")
    return e.upside if e is not None and callable(e.upside) else None


def docs_table() -> str:
    """The table of docs/verdicts.md: verdicts, then job verdicts, then flags."""
    order = [*entries("verdict", "rank"), *entries("verdict", "job"), *entries("flag")]
    rows = ["| verdict / flag | raised when | source |", "|---|---|---|", *(e.docs_row for e in order)]
    return "\n".join(rows) + "\n"


#: views: (headline, meaning) per verdict kind; words per flag kind
VERDICT_WORDS: dict[str, tuple[str, str]] = {e.kind: (e.headline, e.meaning) for e in entries("verdict")}
FLAG_WORDS: dict[str, str] = {e.kind: e.headline for e in entries("flag")}
HELP_VERDICTS: tuple[str, ...] = tuple(e.help for e in entries("verdict") if e.kind != "unknown")
HELP_FLAGS: tuple[str, ...] = tuple(e.help for e in entries("flag"))

if __name__ == "__main__":
    print(docs_table(), end="")
