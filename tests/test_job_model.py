"""The job model (monitor/diagnosis/job_model.py) over synthetic ranks in lockstep: a straggler
only above the job's own noise band and in most seconds, a host-bound job named as such, the
upside a what-if, the headline still over consecutive windows, and the last verdict kept once
the job's ranks are gone (issue 35)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace
from functools import cache

import pytest

from tests.rank_util import T0, batch, hello
from torchtop.contract.wire import HostSample, Telemetry
from torchtop.monitor.diagnosis.facts import Diagnosis, Finding
from torchtop.monitor.diagnosis.job_diagnosis import ENDED, diagnose_job, ended, rank_times, settled_job
from torchtop.monitor.diagnosis.job_model import HostSide, what_if
from torchtop.monitor.diagnosis.job_rules import JobFacts
from torchtop.monitor.diagnosis.selection import job_verdict
from torchtop.monitor.diagnosis.straggler import find_straggler, straggler_finding, work_line
from torchtop.monitor.model.job_state import JobState
from torchtop.monitor.model.rank_stats import RankTimes, Work
from torchtop.monitor.model.steps import StepRecord

# (rank, second since the start, rng) -> the rank's own ms a step in each phase
Own = Callable[[int, int, random.Random], dict[str, float]]
COLLECTIVE_MS = 0.3  # the all-reduce's own time: the rank that arrives last waits only this


class Lockstep:
    """Ranks of a synchronous job: each step lasts as long as its slowest rank's own work plus
    the collective; every other rank waits the difference in `comm` (gloo: the host waits)."""

    def __init__(self, ranks: int, own: Own, seed: int = 0) -> None:
        self.ranks, self.own, self.rng = ranks, own, random.Random(seed)
        self.job = JobState()
        self.t, self.i, self.seq = T0, 0, 0
        self.cpu_wait: Callable[[int], float] | None = None  # a rank's training thread's CPU wait, %
        for r in range(ranks):
            self.job.apply_hello(f"r{r}", hello(r, world=ranks))

    def run(self, seconds: float) -> None:
        """`seconds` more of steps, fed in batches as an agent publishes them."""
        end = self.t + seconds
        while self.t < end:
            per: dict[int, list[StepRecord]] = {r: [] for r in range(self.ranks)}
            stop = min(end, self.t + 0.5)
            while self.t < stop:
                sec = int(self.t - T0)
                own = {r: self.own(r, sec, self.rng) for r in range(self.ranks)}
                wall = max(sum(p.values()) for p in own.values()) + COLLECTIVE_MS
                for r, phases in own.items():
                    ns = {k: int(v * 1e6) for k, v in phases.items()}
                    ns["comm"] = int(wall * 1e6) - sum(ns.values())
                    per[r].append(StepRecord(self.i, self.t, int(wall * 1e6), ns, "train", 1, {}, r))
                self.t += wall / 1e3
                self.i += 1
            for r, steps in per.items():
                b = batch(r, self.seq, self.t)
                if self.cpu_wait is not None:
                    host = HostSample(100.0, 1 << 30, 4, 2, train_wait_percent=self.cpu_wait(r))
                    b.telemetry = Telemetry(time=self.t, host=host)
                self.job.apply_batch(f"r{r}", b, steps, now=self.t)
            self.seq += 1


def phases(
    forward: float = 0.6, backward: float = 1.2, other: float = 0.3, data: float = 0.1
) -> dict[str, float]:
    return {"data": data, "forward": forward, "backward": backward, "optimizer": 0.1, "other": other}


def loaded(rng: random.Random, sd: float = 0.15) -> float:
    """A loaded machine: each step's own work stretched by a random factor."""
    return max(0.5, rng.gauss(1.0, sd))


@cache
def burst(sec: int) -> int | None:
    """The rank that loses its core to a neighbour in second `sec` (None: neither), fixed by
    the second so that every rank's steps in it agree."""
    rng = random.Random(sec * 7919)
    return rng.randrange(2) if rng.random() < 0.25 else None


def noisy_identical(r: int, sec: int, rng: random.Random, scale: float = 1.0) -> dict[str, float]:
    """Identical ranks on a busy 2-core machine: step-to-step jitter, and in some seconds one
    rank runs 2.5x slower for the second."""
    k = loaded(rng) * (2.5 if burst(sec) == r else 1.0) * scale
    return phases(0.6 * k, 1.2 * k, 0.3 * k)


def windows(job: Lockstep, n: int = 10) -> tuple[list[str], list[int], int]:
    """`n` consecutive 10 s windows as a live view judges them (each with the one before in
    force): their headlines, the stragglers named, and how many the windows' means alone (the
    fixed 5% band, no per-second figures) would have named."""
    previous: Diagnosis | None = None
    kinds: list[str] = []
    named: list[int] = []
    fixed = 0
    for _ in range(n):
        job.run(10)
        previous, found = diagnose_job(job.job, previous)
        kinds.append(previous.verdict.kind)
        named += [found.rank] if found is not None else []
        fixed += find_straggler(rank_times(job.job)) is not None
    return kinds, named, fixed


def test_identical_noisy_ranks_name_no_straggler_and_hold_one_headline() -> None:
    """Ten consecutive 10 s windows of identical ranks under load: one headline in at least 9,
    never a straggler; the windows' means alone name one in some (before: "straggler rank 1" /
    "rank 0" / "communication" by the window)."""
    job = Lockstep(2, lambda r, sec, rng: noisy_identical(r, sec, rng, 4.0), seed=1)  # a 9 ms step
    job.run(12)
    kinds, named, fixed = windows(job)
    assert not named and "straggler" not in kinds, kinds
    assert max(kinds.count(k) for k in set(kinds)) >= 9, kinds
    assert fixed >= 2


def test_a_3_ms_toy_with_a_tenth_of_a_ms_more_backward_is_no_straggler() -> None:
    """ "Straggler warning: backward compute 1.1 ms vs 1.0 ms median" on a 3 ms toy DDP job: 0.1 ms
    more backward on rank 1, and the seconds' load on a busy machine."""

    def toy(r: int, sec: int, rng: random.Random) -> dict[str, float]:
        p = noisy_identical(r, sec, rng)
        return dict(p, forward=p["forward"] * 0.8, backward=p["backward"] * 0.83 + (0.1 if r == 1 else 0.0))

    job = Lockstep(2, toy, seed=3)
    job.run(12)
    kinds, named, fixed = windows(job, 4)
    assert not named and "straggler" not in kinds, kinds
    assert fixed >= 1


def test_a_persistent_slow_rank_is_named_with_a_plain_upside() -> None:
    def slow_backward(r: int, sec: int, rng: random.Random) -> dict[str, float]:
        k = loaded(rng, 0.1)
        return phases(0.6 * k, (2.4 if r == 2 else 1.2) * k, 0.3 * k)

    job = Lockstep(4, slow_backward, seed=5)
    job.run(14)
    d, found = diagnose_job(job.job)
    assert found is not None and (found.rank, found.phase) == (2, "backward"), d.verdict.evidence
    assert d.verdict.kind == "straggler"
    assert found.noise.measured and found.slowest[0] >= 0.6 * found.slowest[1]
    assert any(e.startswith("confidence high") for e in d.verdict.evidence), d.verdict.evidence
    up = d.verdict.upside
    assert up is not None and up.speedup is not None and 1.2 < up.speedup < 1.6, up
    assert "e+" not in up.text and "x slower" in " ".join(d.verdict.evidence)
    assert "its host" in " ".join(d.verdict.evidence) or found.work is None  # a CPU job: never "its GPU"


@pytest.mark.parametrize("waits", [(2.0, 45.0), (30.0, 35.0)], ids=["starved", "all-busy"])
def test_a_straggler_that_waits_for_a_cpu_is_said_to_be_its_host(waits: tuple[float, float]) -> None:
    """Rank 2's training thread waits for a core 45% of the time, the others' 2%: the verdict
    says its host is oversubscribed and advises about the host first. Where every rank waits
    alike (30-35%), that is not the straggler's reason and nothing is added."""

    def slow_backward(r: int, sec: int, rng: random.Random) -> dict[str, float]:
        k = loaded(rng, 0.1)
        return phases(0.6 * k, (2.4 if r == 2 else 1.2) * k, 0.3 * k)

    job = Lockstep(4, slow_backward, seed=5)
    job.cpu_wait = lambda r: waits[1] if r == 2 else waits[0]
    job.run(14)
    d, found = diagnose_job(job.job)
    assert found is not None and found.rank == 2 and d.verdict.kind == "straggler", d.verdict
    said = [e for e in d.verdict.evidence if "waited for a CPU" in e]
    if waits[0] < 10:
        assert said == ["rank 2's training thread waited for a CPU 45% of the time (the other ranks 2%): "
                        "its host is oversubscribed, not its work"], d.verdict.evidence  # fmt: skip
        assert d.verdict.evidence.index(said[0]) == 1 and "cores of its own" in d.verdict.advice[0]
    else:
        assert said == [] and "cores of its own" not in " ".join(d.verdict.advice), d.verdict


def test_a_one_off_spike_is_not_a_straggler() -> None:
    """Rank 1 stalls for 2 s of 12 (a checkpoint): its 10 s mean is far above the others', but
    it is ahead of them in a few seconds only."""

    def spike(r: int, sec: int, rng: random.Random) -> dict[str, float]:
        k = loaded(rng, 0.1)
        stall = 12.0 if r == 1 and sec in (6, 7) else 0.0
        return phases(0.6 * k, 1.2 * k, 0.3 * k + stall)

    job = Lockstep(4, spike, seed=7)
    job.run(13)
    from torchtop.monitor.diagnosis.job_diagnosis import rank_times

    assert find_straggler(rank_times(job.job)) is not None  # its means alone name it
    d, found = diagnose_job(job.job)
    assert found is None and d.verdict.kind != "straggler", d.verdict.evidence


def test_a_rank_that_slows_mid_run_is_named_within_the_window() -> None:
    """A rank slows after a minute of identical ranks: it is named within the 10 s window (issue
    35: planted stragglers named within 10 s), not once it has been slower for most of a minute;
    whether it was slower before is its persistence, said beside it."""

    def stalled(r: int, sec: int, rng: random.Random) -> dict[str, float]:
        k = loaded(rng, 0.1) * (1.8 if r == 0 and sec >= 62 else 1.0)
        return phases(2.4 * k, 4.8 * k, 1.2 * k)

    job = Lockstep(2, stalled, seed=13)
    job.run(62 + 7)  # 7 s after it slowed
    d, found = diagnose_job(job.job)
    assert found is not None and found.rank == 0 and d.verdict.kind == "straggler", d.verdict.evidence


def _cuda(
    step: float, forward: float, backward: float, comm: float, dev_forward: float, dev_comm: float
) -> RankTimes:
    host = {"data": 0.3, "h2d": 0.0, "forward": forward, "backward": backward, "optimizer": 2.0, "comm": comm}
    host["other"] = max(0.0, step - sum(host.values()))
    dev = {
        "h2d": 0.0,
        "forward": dev_forward,
        "backward": 3.0,
        "optimizer": 0.5,
        "comm": dev_comm,
        "step": step,
    }
    return RankTimes(100, step, 100, host, 25, dev)


def test_a_host_bound_job_is_named_so_with_no_straggler_and_no_upside() -> None:
    """The public FSDP2 example on 2 H200s: both hosts busy the whole ~70 ms step, the GPUs
    computing 2-17% of it; rank 1's device forward span (19.7 ms) holds its wait for each launch
    while rank 0's device idles in NCCL. Was "Straggler critical ... 2.9x"."""
    times = {0: _cuda(70.0, 17.0, 38.3, 1.0, 1.2, 40.0), 1: _cuda(70.0, 19.9, 33.1, 1.0, 19.7, 2.0)}
    assert find_straggler(times) is not None  # the device spans alone: the old straggler
    hosts = {
        0: HostSide(
            0.02, "GPM SM activity", 0.0, "forward: 31% in torch/distributed/tensor/_dispatch.py:200"
        ),
        1: HostSide(0.17, "GPM SM activity"),
    }
    j = JobFacts(times, "compute", hosts=hosts, gpu=True)
    assert j.straggler() is None
    v = job_verdict(j)
    assert v is not None and v.kind == "host-bound" and v.severity == "critical", v
    text = " ".join(v.evidence)
    assert "_dispatch.py" in text and "2-17%" in text
    assert v.upside is not None and (v.upside.speedup or 1.0) <= 1.1 and "no measurable gain" in v.upside.text
    # a GPU that computes (the planted GPU straggler's own) is no host-bound job
    busy = {0: hosts[0], 1: HostSide(0.8, "GPM SM activity")}
    assert job_verdict(JobFacts(times, "compute", hosts=busy, gpu=True)).kind == "straggler"  # type: ignore[union-attr]


def test_a_cpu_job_is_never_host_bound_and_its_straggler_is_its_host() -> None:
    def slow(r: int, sec: int, rng: random.Random) -> dict[str, float]:
        return phases(0.6, 3.0 if r == 1 else 1.2, 0.3)

    job = Lockstep(2, slow)
    job.run(12)
    d, found = diagnose_job(job.job)
    assert found is not None and not found.gpu and d.verdict.kind == "straggler"
    same = replace(found, work=Work(8, 0, 0), median_work=Work(8, 0, 0))
    line = work_line(same)
    assert line is not None and line.endswith("its host"), line  # was "its GPU or its host" on CPU
    assert "GPU or its host" in (work_line(replace(same, gpu=True)) or "")
    assert "x slower" not in " ".join(
        straggler_finding(replace(found, new_step_ms=found.step_ms / 1.05)).evidence
    )


def test_the_what_if_is_said_plainly() -> None:
    up = what_if("rank 1 at the others' pace", 58.6, 0.15)
    assert up is not None and up.speedup == 10.0 and "over 10×" in up.text and "e+" not in up.text
    same = what_if("balancing", 70.0, 69.8, band=0.5)
    assert same is not None and same.speedup == 1.0 and "no measurable gain" in same.text
    fine = what_if("x", 10.0, 6.25)
    assert fine is not None and "1.6×" in fine.text


def test_a_job_verdict_in_force_yields_only_to_a_clearly_stronger_one() -> None:
    """A straggler that clears its band only just does not displace `communication` in force."""
    step = 100.0

    def rank(comm: float, backward: float) -> RankTimes:
        return RankTimes(
            50, step, 50, {"forward": 2.0, "backward": backward, "optimizer": 1.0, "comm": comm}, 0, {}
        )

    wait = 0.055 * step  # past the 5% band, short of 1.25 x it
    times = {0: rank(30.0, 10.0 + wait), 1: rank(30.0 + wait, 10.0), 2: rank(30.0 + wait, 10.0)}
    j = JobFacts(times, "compute")
    assert job_verdict(j).kind == "straggler"  # type: ignore[union-attr]
    assert job_verdict(j, "communication").kind == "communication"  # type: ignore[union-attr]
    times[0] = rank(30.0, 10.0 + 3 * wait)
    times[1], times[2] = rank(30.0 + 3 * wait, 10.0), rank(30.0 + 3 * wait, 10.0)
    assert job_verdict(JobFacts(times, "compute"), "communication").kind == "straggler"  # type: ignore[union-attr]


def test_nothing_standing_out_is_said() -> None:
    def even(r: int, sec: int, rng: random.Random) -> dict[str, float]:
        k = loaded(rng, 0.02)
        return phases(1.5 * k, 2.0 * k, 2.5 * k, 1.5 * k)  # compute 46%, the rest spread thin

    job = Lockstep(2, even, seed=11)
    job.run(14)
    d, found = diagnose_job(job.job)
    assert found is None and d.verdict.kind == "no-bottleneck" and d.verdict.severity == "ok", d.verdict
    assert "noise band" in " ".join(d.verdict.evidence)


def test_an_ended_job_keeps_its_last_verdict_marked() -> None:
    def slow(r: int, sec: int, rng: random.Random) -> dict[str, float]:
        return phases(0.6, 3.0 if r == 1 else 1.2, 0.3)

    job = Lockstep(2, slow)
    job.run(12)
    live, _ = diagnose_job(job.job)
    assert live.verdict.kind == "straggler"
    job.job.lost("r0", "gone")
    one_left, _ = diagnose_job(job.job, live)
    assert one_left is live  # one rank left: the job's verdict still stands
    job.job.lost("r1", "gone")
    last, _ = diagnose_job(job.job, one_left)
    assert ended(last) and last.verdict.evidence[0] == ENDED and last.verdict.kind == "straggler"
    assert diagnose_job(job.job, last)[0] is last  # marked once


def test_a_report_judges_the_window_before_as_the_verdict_in_force() -> None:
    """A straggler just under its band in the last window, over it in the one before: a live
    view keeps it (hysteresis), so does the report of the same steps."""

    def fading(r: int, sec: int, rng: random.Random) -> dict[str, float]:
        slow = 0.75 if sec < 12 else 0.45  # ms more backward on rank 1: 7.5% of the step, then 4.5%
        return phases(0.6, 8.0 + (slow if r == 1 else 0.0), 0.3)

    job = Lockstep(3, fading)
    job.run(22.5)
    assert diagnose_job(job.job)[0].verdict.kind != "straggler"
    d, found = settled_job(job.job, 10.0)
    assert found is not None and d.verdict.kind == "straggler", d.verdict.evidence


@pytest.mark.parametrize("kind", ["host-bound", "no-bottleneck"])
def test_new_job_verdicts_read_the_same_on_every_rank(kind: str) -> None:
    from torchtop.monitor.diagnosis.in_job import rank_diagnosis

    job = Diagnosis(Finding(kind, "warning", 0.9, ("every rank's host is busy",)), (), 50)
    own = Diagnosis(Finding("host-overhead", "critical", 0.9, ("GPU busy 5%",)), (), 50)
    got = rank_diagnosis(own, 0, job, None, {})
    assert got.verdict.kind == (kind if kind == "host-bound" else "host-overhead")


def test_a_ranks_gpu_is_read_from_its_counters_before_nvml() -> None:
    """GPM's SM activity where the GPU reads it (NVML calls a GPU spinning in NCCL 100% busy),
    else the smaller of NVML and the CUDA events; a CPU rank's GPU is not known."""
    from torchtop.monitor.diagnosis.facts import Facts
    from torchtop.monitor.diagnosis.gpm import GpmFigures
    from torchtop.monitor.diagnosis.job_model import host_side
    from torchtop.monitor.diagnosis.why import WhyFacts

    f = Facts(100, 70.0, {}, {}, device="cuda", gpu_util=100.0, gpm=GpmFigures(4.0, 0.0, 0.0))
    assert host_side(f)[:2] == (0.04, "GPM SM activity")
    f.gpm, f.why = None, WhyFacts()
    f.why.throughput.device_busy_ms, f.why.throughput.device_step_ms = 7.0, 70.0
    assert host_side(f)[:2] == (pytest.approx(0.1), "CUDA events")
    assert host_side(Facts(100, 70.0, {}, {})).gpu_busy is None
