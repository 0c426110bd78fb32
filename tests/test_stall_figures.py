"""Issue 35, "numbers that don't add up": a DataLoader worker that restarts each epoch stalls one
step for seconds; phase sampling may skip timing it. The stall's phases come from its stack
samples, a verdict's "X% of step time: A ms of B ms" adds up, the job's figures are its ranks' own
(pooled), and a worker still starting is not "no DataLoader worker processes"."""

from __future__ import annotations

import re

import pytest

from torchtop.contract.wire import (
    PROTOCOL_VERSION,
    Batch,
    Hello,
    HostSample,
    StackSample,
    Telemetry,
    Why,
    WorkerSample,
)
from torchtop.monitor.diagnosis.diagnose import diagnose
from torchtop.monitor.diagnosis.job_diagnosis import diagnose_job
from torchtop.monitor.model.hotspots import STALL_NS, stall_phases
from torchtop.monitor.model.job_state import JobState
from torchtop.monitor.model.state import RunState, breakdown
from torchtop.monitor.model.steps import StepRecord

T0 = 1_000_000.0
FAST_NS = 10_000_000  # 10 ms steps, 3.6 ms of them data wait
STALL_S = 9.0


def _hello(rank: int = 0) -> Hello:
    return Hello(
        v=PROTOCOL_VERSION,
        run_id=f"r{rank}",
        pid=100 + rank,
        host="h",
        port=1,
        pub_port=2,
        device="cpu",
        start_time=T0 - 5,
        rank=rank,
        world_size=2,
        job_id="j",
    )


def _epoch(rank: int = 0, stall_timed: bool = False) -> tuple[list[StepRecord], list[StackSample], float]:
    """A 9 s stall (a worker starting: data wait), then 100 fast steps: the steps, the stack
    samples of the stall (20 Hz, on the agent's perf_counter clock: wall offset T0), its end."""
    steps: list[StepRecord] = []
    stall_ns = int(STALL_S * 1e9)
    phases = {"data": stall_ns * 9 // 10, "other": stall_ns - stall_ns * 9 // 10} if stall_timed else {}
    steps.append(StepRecord(20, T0, stall_ns, phases, rank=rank))
    samples = [
        StackSample(t=int((k / 20) * 1e9), phase=0 if k % 10 else 6) for k in range(int(STALL_S * 20))
    ]  # 9 in 10 in the data phase
    t = T0 + STALL_S
    for i in range(21, 121):
        timed = {"data": 3_600_000, "forward": 4_000_000, "other": 2_400_000} if i % 4 == 0 else {}
        steps.append(StepRecord(i, t, FAST_NS, timed, rank=rank))
        t += FAST_NS / 1e9
    return steps, samples, t


def test_a_stall_phase_sampling_skipped_gets_its_phases_from_its_stack_samples() -> None:
    steps, samples, end = _epoch()
    held = [(T0 + s.t / 1e9, s) for s in samples]
    got = stall_phases(steps, held)
    assert got[0].phases and got[0].phases["data"] == pytest.approx(0.9 * STALL_S * 1e9, rel=0.01)
    assert sum(got[0].phases.values()) == got[0].wall_ns  # they add up
    assert got[1:] == steps[1:]  # fast untimed steps stay untimed
    assert stall_phases(steps, held[:3]) == steps  # too few samples: not guessed
    assert steps[0].wall_ns >= STALL_NS
    # through a RunState: the breakdown holds the stall's data wait
    state = RunState()
    state.apply_hello(_hello())
    state.apply_batch(
        Batch(v=PROTOCOL_VERSION, run_id="r0", seq=0, time=end, wall_offset=T0, why=Why(stacks=samples)),
        steps,
        0.0,
    )
    assert breakdown(state.steps)["data"] > 0.8


def _numbers(line: str) -> tuple[float, float, float]:
    m = re.search(r"(\d+)% of step time: ([\d.]+) ms of ([\d.]+) ms", line)
    assert m, line
    return float(m.group(1)) / 100, float(m.group(2)), float(m.group(3))


def test_the_data_line_adds_up_when_an_untimed_stall_is_in_the_steps() -> None:
    """No stack samples: the stall stays untimed; the share is the timed steps', and its ms is
    that share of the mean step (before: 36% of step time: 3.6 ms of 98.1 ms)."""
    steps, _, end = _epoch()
    state = RunState()
    state.apply_hello(_hello())
    state.apply_batch(Batch(v=PROTOCOL_VERSION, run_id="r0", seq=0, time=end), steps, 0.0)
    d = diagnose(state)
    assert d.verdict.kind == "data-loading", d.verdict
    share, ms, step = _numbers(d.verdict.evidence[0])
    assert ms / step == pytest.approx(share, abs=0.01), d.verdict.evidence[0]


def _host(workers: list[WorkerSample]) -> Telemetry:
    return Telemetry(
        time=T0, host=HostSample(proc_cpu=50.0, proc_rss=1, threads=4, cpu_count=8, workers=workers)
    )


@pytest.mark.parametrize(
    ("children", "said"),
    [
        ([], True),  # no child at all: loading runs on the training process
        ([WorkerSample(pid=7, cpu_percent=1.0, rss=1, name="python3.11")], False),  # a worker starting
        ([WorkerSample(pid=8, cpu_percent=0.0, rss=1, name="torchtop-relay")], True),  # the node's relay
    ],
)
def test_no_workers_is_said_only_when_no_child_could_be_one_starting(
    children: list[WorkerSample], said: bool
) -> None:
    steps, _, end = _epoch(stall_timed=True)
    state = RunState()
    state.apply_hello(_hello())
    batch = Batch(v=PROTOCOL_VERSION, run_id="r0", seq=0, time=end, telemetry=_host(children))
    state.apply_batch(batch, steps, 0.0)
    d = diagnose(state)
    assert d.verdict.kind == "data-loading", d.verdict
    assert (
        "no DataLoader worker processes: loading runs on the training process" in d.verdict.evidence
    ) is said


def test_the_job_data_share_is_its_ranks_own() -> None:
    """Two ranks, each stalled 9 s for its worker; rank 1's stall timed, rank 0's skipped by
    phase sampling but sampled by its stack sampler: the job's data share is within 10 points
    of each rank's own (the aggregate of the ranks' records read 36% when the stall went untimed)."""
    job = JobState("j")
    own: list[float] = []
    for rank in (0, 1):
        key = f"r{rank}"
        job.apply_hello(key, _hello(rank))
        steps, samples, end = _epoch(rank, stall_timed=rank == 1)
        why = Why(stacks=samples) if rank == 0 else None
        batch = Batch(v=PROTOCOL_VERSION, run_id=key, seq=0, time=end, wall_offset=T0, rank=rank, why=why)
        job.apply_batch(key, batch, steps, 0.0)
        d = diagnose(job.members[key].state)
        assert d.verdict.kind == "data-loading", d.verdict
        own.append(_numbers(d.verdict.evidence[0])[0])
    verdict = diagnose_job(job)[0].verdict
    assert verdict.kind == "data-loading", verdict
    share = _numbers(verdict.evidence[0])[0]
    assert all(abs(share - o) <= 0.10 for o in own), (share, own)
