"""The job's pure parts: identity from the launcher, the comm split in the replay, the straggler
and scaling rules at their thresholds, the job state (aggregate, refusals, gone ranks), buckets,
host lists and job grouping. No sockets, no processes."""

from __future__ import annotations

import pytest

from tests.rank_util import JOB, batch, feed, hello, rank_steps
from torchtop.agent.identity import from_env
from torchtop.contract.discovery import AgentInfo
from torchtop.contract.logcodes import BACKWARD, BOUNDARY, COMM, COMM_READY, EXIT, FORWARD_START, SHIFT
from torchtop.monitor.diagnosis.facts import THRESHOLDS as T
from torchtop.monitor.diagnosis.job_diagnosis import build_job_report, diagnose_job, rank_times
from torchtop.monitor.diagnosis.straggler import find_straggler, rule_communication, scaling
from torchtop.monitor.link.hosts import expand_nodelist, read_hosts_file, slurm_targets
from torchtop.monitor.link.job_targets import choose_job, group_by_job, ranks_text, short_job_id
from torchtop.monitor.link.targets import TargetError
from torchtop.monitor.model.job_state import JobState
from torchtop.monitor.model.rank_stats import RankStats, RankTimes
from torchtop.monitor.model.ranks_view import ranks_view
from torchtop.monitor.model.replay import StepRecorder
from torchtop.monitor.model.step_pack import to_record


# -- identity ------------------------------------------------------------------------------------
def test_identity_from_torchrun() -> None:
    env = {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
        "TORCHELASTIC_RUN_ID": "abc", "MASTER_ADDR": "node0", "MASTER_PORT": "29500",
    }  # fmt: skip
    ident = from_env(env)
    assert (ident.rank, ident.world_size, ident.local_rank, ident.local_world_size) == (5, 8, 1, 4)
    assert ident.node_rank == 1 and ident.launcher == "torchrun"
    assert ident.job_id == "abc@node0:29500"
    # torchrun's default rdzv id is the word "none": the rendezvous address alone tells jobs apart
    assert from_env({**env, "TORCHELASTIC_RUN_ID": "none"}).job_id == "node0:29500"
    assert from_env({**env, "MASTER_PORT": "29501"}).job_id != ident.job_id


def test_identity_from_slurm_and_alone() -> None:
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "16", "SLURM_LOCALID": "3", "SLURM_NODEID": "0",
           "SLURM_JOB_ID": "777", "SLURM_STEP_ID": "2"}  # fmt: skip
    ident = from_env(env)
    assert (ident.rank, ident.world_size, ident.node_rank, ident.launcher) == (3, 16, 0, "slurm")
    assert ident.job_id == "slurm-777.2"
    alone = from_env({"MASTER_ADDR": "x", "MASTER_PORT": "1"})  # set but no rank: not a job yet
    assert (alone.rank, alone.world_size, alone.job_id) == (0, 1, "")


# -- the comm split in the replay ----------------------------------------------------------------
def _at(t: int, code: int) -> int:
    return t << SHIFT | code


def test_comm_ready_ends_the_backward_compute() -> None:
    """COMM_READY inside a backward: before it is backward, after it (DDP's wait) is comm; a
    blocking collective is comm too; phases still add up to the step."""
    log = [
        _at(100, BOUNDARY),
        _at(110, FORWARD_START + 3),
        _at(130, EXIT | 2),
        _at(130, BACKWARD),
        _at(160, COMM_READY),
        _at(200, EXIT | BACKWARD),
        _at(205, COMM),  # dist.all_reduce(loss) in `other`
        _at(215, EXIT | COMM),
        _at(220, BOUNDARY),
    ]
    (raw,) = StepRecorder().feed(log)
    rec = to_record(raw, 0.0, 0)
    assert rec.phases["backward"] == 30 and rec.phases["comm"] == 40 + 10
    assert sum(rec.phases.values()) == rec.wall_ns == 120


def test_comm_ready_splits_the_device_times() -> None:
    """On a sampled CUDA step the ready event splits the backward's device time the same way."""
    log = [
        (_at(100, BOUNDARY), 0.0, 0),
        (_at(110, 23), 0.0),  # STEP_EVENT
        (_at(130, BACKWARD), 1.0),
        (_at(160, COMM_READY), 4.0),
        (_at(200, EXIT | BACKWARD), 9.5),
        (_at(220, BOUNDARY), 10.0, 0),
    ]
    rec = StepRecorder()
    rec.feed(log[:1])
    (raw,) = rec.feed(log[1:])
    device = to_record(raw, 0.0, 0).device_ms
    assert device["backward"] == pytest.approx(3.0) and device["comm"] == pytest.approx(5.5)


def test_comm_ready_outside_a_backward_means_nothing() -> None:
    log = [_at(100, BOUNDARY), _at(110, COMM_READY), _at(150, BOUNDARY)]
    (raw,) = StepRecorder().feed(log)
    assert to_record(raw, 0.0, 0).phases["comm"] == 0


# -- straggler and scaling -----------------------------------------------------------------------
def times(step: float, comm: float, **phases: float) -> RankTimes:
    base = {"data": 1.0, "h2d": 0.0, "forward": 3.0, "backward": 5.0, "optimizer": 1.0, "comm": comm}
    base.update(phases)
    base["other"] = max(0.0, step - sum(base.values()))
    return RankTimes(100, step, 100, base, 0, {})


def test_a_slow_loader_is_named_with_its_cost() -> None:
    ranks = {r: times(90, 80) for r in range(8)}
    ranks[3] = times(90, 39, data=41)  # the others wait ~41 ms for its data
    s = find_straggler(ranks)
    assert s is not None and (s.rank, s.phase, s.severity) == (3, "data", "critical")
    assert s.wait_ms == pytest.approx(41) and s.waiting == 7
    assert s.slowdown == pytest.approx(90 / 49)


def test_a_slow_backward_is_named_though_every_backward_looks_alike() -> None:
    """Host time in backward (compute + DDP's wait) is the same on every rank: the comm split
    tells the rank that computes from the ranks that wait (TraceML #252)."""
    ranks = {r: times(60, 40, backward=10) for r in range(4)}
    ranks[2] = times(60, 10, backward=40)
    assert {round(t.phases["backward"] + t.comm_ms) for t in ranks.values()} == {50}
    s = find_straggler(ranks)
    assert s is not None and (s.rank, s.phase) == (2, "backward")
    assert s.phase_ms == 40 and s.median_ms == 10 and s.wait_ms == 30


def test_device_comm_and_compute_are_used_where_sampled() -> None:
    """On NCCL the host does not wait at the end of backward: the device times say who waits."""
    dev = {"forward": 3.0, "backward": 8.0, "optimizer": 1.0, "comm": 20.0, "step": 33.0}

    def cuda(**over: float) -> RankTimes:
        t = times(33, 0.1, backward=1.0)
        return t._replace(sampled=10, device=dev | over)

    ranks = {0: cuda(), 1: cuda(), 2: cuda(backward=27.0, comm=1.0)}
    s = find_straggler(ranks)
    assert s is not None and (s.rank, s.phase) == (2, "backward") and s.wait_ms == pytest.approx(19)


@pytest.mark.parametrize(
    ("extra_wait", "severity"),
    [(0.04, None), (0.06, "info"), (0.12, "warning"), (0.25, "critical")],
)
def test_straggler_bands(extra_wait: float, severity: str | None) -> None:
    ranks = {r: times(100, 10 + 100 * extra_wait) for r in range(4)}
    ranks[1] = times(100, 10, data=1 + 100 * extra_wait)
    s = find_straggler(ranks)
    assert (s.severity if s else None) == severity


def test_no_straggler_when_every_rank_waits_alike() -> None:
    ranks = {r: times(50, 30 + 0.1 * r) for r in range(4)}
    assert find_straggler(ranks) is None
    comm = rule_communication(ranks, 50)
    assert comm is not None and comm.kind == "communication" and comm.severity == "critical"


def test_unexplained_lateness_names_the_rank_without_a_phase() -> None:
    ranks = {r: times(50, 30) for r in range(4)}
    # late by 25 ms, spread thinly over every phase: none of them explains the others' wait
    ranks[0] = times(50, 5, data=6.0, forward=8.0, backward=10.0, optimizer=6.0)
    s = find_straggler(ranks)
    assert s is not None and s.rank == 0 and s.phase == ""


def test_scaling_splits_the_step() -> None:
    ranks = {r: times(100, 60) for r in range(4)}
    ranks[3] = times(100, 20, data=41)
    sc = scaling(ranks, baseline_ms=25.0)
    assert sc is not None
    j = sc.to_json()
    assert j["efficiency"] == pytest.approx(0.09) and j["lost_to_communication"] == pytest.approx(0.2)
    assert j["lost_to_waiting"] == pytest.approx(0.4) and j["vs_baseline"] == pytest.approx(0.25)


# -- the job state -------------------------------------------------------------------------------
def test_job_aggregate_and_report() -> None:
    job = JobState()
    per = {r: rank_steps(r, step_ms=60, comm=45) for r in range(4)}
    per[1] = rank_steps(1, step_ms=60, data=41, comm=5)
    feed(job, per)
    assert job.job_id == JOB and len(job.job.steps) == 100
    agg = job.job.steps[-1]
    assert agg.phases["data"] == pytest.approx((3 * 1 + 41) / 4 * 1e6)
    assert sum(agg.phases.values()) == agg.wall_ns
    d, s = diagnose_job(job)
    assert s is not None and s.rank == 1 and d.verdict.kind == "straggler"
    report = build_job_report(job, 10.0, "test")
    assert [e["rank"] for e in report["ranks"]] == [0, 1, 2, 3]
    assert report["straggler"]["rank"] == 1 and report["straggler"]["phase"] == "data"
    assert report["collective"]["min_ms"] == pytest.approx(5, abs=0.01)
    assert report["scaling"]["lost_to_waiting"] > 0.5


def test_another_jobs_agent_is_refused_and_versions_are_told() -> None:
    job = JobState()
    assert job.apply_hello("a", hello(0))
    assert not job.apply_hello("b", hello(1, job_id="other@x:1"))
    assert job.members["b"].refused and "not shown" in job.notes[0]
    assert [m.key for m in job.ranked()] == ["a"]
    job.apply_hello("c", hello(2, version="0.2.0"))
    assert job.versions() == {"0.1.0": [0], "0.2.0": [2]}


def test_a_gone_rank_does_not_hold_the_aggregate_back() -> None:
    job = JobState()
    per = {r: rank_steps(r, n=40) for r in range(3)}
    feed(job, {r: s[:20] for r, s in per.items()})
    job.lost("r2", "no answer")
    assert job.members["r2"].state.connection(0.0) == "agent gone"
    for r in (0, 1):
        job.apply_batch(f"r{r}", batch(r, 99, per[r][-1].t0), per[r][20:], now=5.0)
    assert len(job.job.steps) == 40  # the live ranks' steps go on without rank 2
    assert set(rank_times(job)) == {0, 1}


def test_rank_stats_windows_and_series() -> None:
    stats = RankStats()
    steps = rank_steps(0, n=300, step_ms=100.0, data=10.0)  # 30 s of 100 ms steps
    stats.add(steps)
    stats.add(steps[-5:])  # a snapshot's overlap is not counted twice
    w = stats.window(10.0)  # whole seconds: within a second of the 10 s
    assert 85 <= w.steps <= 105 and w.step_ms == pytest.approx(100.0)
    assert w.phases["data"] == pytest.approx(10.0)
    assert stats.window(1e9).steps == 300
    series = stats.series(10, 10)
    assert sum(t.steps for _, t in series) == 300 and len(series) in (3, 4)


def test_ranks_view_strip_rises_for_a_rank_that_slows() -> None:
    job = JobState()
    per = {r: rank_steps(r, n=600, step_ms=100.0, comm=50.0) for r in range(3)}
    late = rank_steps(2, n=600, step_ms=100.0, comm=50.0)
    per[2] = late[:300] + rank_steps(2, n=300, step_ms=100.0, backward=40.0, comm=15.0, first=300)
    for r in (0, 1):
        per[r] = per[r][:300] + rank_steps(r, n=300, step_ms=100.0, comm=85.0, first=300)
    feed(job, per, chunk=50)
    view = ranks_view(job, 10.0, None, 0.0)
    strips = {row.rank: row.strip for row in view.rows}
    assert view.slowest[0] == 2
    assert strips[2][-1] == "█" and strips[2][0] in "▁▂▃" and strips[0][-1] in "▁▂"


# -- hosts and jobs ------------------------------------------------------------------------------
def test_slurm_nodelists_expand(tmp_path) -> None:
    assert expand_nodelist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert expand_nodelist("a[9-10]b") == ["a9b", "a10b"]
    assert slurm_targets(None, {"SLURM_JOB_NODELIST": "n[1-2]"}) == ["ssh://n1", "ssh://n2"]
    with pytest.raises(TargetError, match="SLURM_JOB_NODELIST"):
        slurm_targets(None, {})
    with pytest.raises(TargetError):
        expand_nodelist("gpu[3-1]")
    hosts = tmp_path / "hosts"
    hosts.write_text("# the nodes\nnode1\nssh://me@node2:2222  # a comment\n\nnode1\n")
    assert read_hosts_file(str(hosts)) == ["ssh://node1", "ssh://me@node2:2222"]


def test_agents_group_by_job_and_two_jobs_need_a_choice() -> None:
    a = [
        AgentInfo(pid=1, rank=1, job_id="j1@h:1", world_size=2),
        AgentInfo(pid=2, rank=0, job_id="j1@h:1", world_size=2),
        AgentInfo(pid=3, rank=0, job_id="j2@h:2", world_size=1),
        AgentInfo(pid=4, rank=0),
    ]
    groups = group_by_job(a)
    assert [(g.job_id, g.ranks) for g in groups] == [("j1@h:1", [0, 1]), ("j2@h:2", [0]), ("", [0])]
    with pytest.raises(TargetError, match="--job j1@h:1"):
        choose_job(groups, None, "here")
    assert choose_job(groups, "j2", "here").job_id == "j2@h:2"
    assert ranks_text([0, 1, 2, 3, 5, 7, 8]) == "0-3,5,7-8"
    assert short_job_id("97ac7439-a36c-4c81-87b9-a84191159939@localhost:36579") == "97ac7439…@localhost:36579"


def test_thresholds_are_in_the_table() -> None:
    assert T.straggler_warning == 0.10 and T.straggler_critical == 0.20


def test_the_gpu_scripts_exposed_wait_from_a_trace(tmp_path) -> None:
    """tests/gpu/job_nccl.py's reading of a profiler trace: NCCL kernel time launched in a step and
    not overlapped by another kernel (it runs only on the GPU machine; its arithmetic here)."""
    import gzip
    import json

    from tests.gpu.job_nccl import profiler_exposed_ms

    def x(name: str, cat: str, ts: float, dur: float, corr: int | None = None) -> dict:
        return {
            "ph": "X",
            "name": name,
            "cat": cat,
            "ts": ts,
            "dur": dur,
            "args": {} if corr is None else {"correlation": corr},
        }

    events = [
        x("ProfilerStep#0", "user_annotation", 0, 100), x("ProfilerStep#1", "user_annotation", 100, 100),
        x("cudaLaunchKernel", "cuda_runtime", 10, 1, 1), x("cudaLaunchKernel", "cuda_runtime", 20, 1, 2),
        x("cudaLaunchKernel", "cuda_runtime", 120, 1, 3),
        x("gemm", "kernel", 30, 40, 1),  # compute 30..70
        x("ncclDevKernel_AllReduce", "kernel", 50, 50, 2),  # 50..100: 30 us exposed
        x("ncclKernel_AllReduce", "kernel", 150, 20, 3),  # step 1: 20 us, nothing overlaps
    ]  # fmt: skip
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as fh:
        json.dump({"traceEvents": events}, fh)
    assert profiler_exposed_ms(path) == {0: 0.030, 1: 0.020}


def test_a_balanced_pipeline_is_its_bubble_not_communication() -> None:
    from torchtop.monitor.diagnosis.job_rules import JobFacts, rule_communication, rule_pipeline_bubble

    ranks = {r: times(50, 12) for r in range(2)}
    j = JobFacts(ranks, "compute", {0: 11.0, 1: 12.0})
    f = rule_pipeline_bubble(j)
    assert f is not None and f.kind == "pipeline-bubble" and f.severity == "warning"  # 22% of the step
    assert "pipeline bubble 24% of the step" in f.evidence[1]
    assert rule_communication(j) is None  # the send/recv wait is the bubble, not collective wait
    assert rule_communication(JobFacts(ranks, "compute")) is not None
    assert rule_pipeline_bubble(JobFacts(ranks, "compute", {0: 2.0, 1: 12.0})) is None  # under 5% on one
    assert rule_pipeline_bubble(JobFacts(ranks, "compute", {0: 11.0})) is None  # one stage seen


def test_pipeline_stages_within_a_tenth_are_balanced_not_a_straggler() -> None:
    """A pipeline is split by whole layers and its last stage also runs the loss: stages ~7%
    apart are as balanced as a partition gets (the bubble is the verdict). DDP ranks that far
    apart are a straggler; a stage 20% slower is one too."""
    from torchtop.monitor.diagnosis.job_rules import JobFacts, rule_pipeline_bubble, rule_straggler

    ranks = {0: times(50, 15.5), 1: times(50, 12, forward=6.5)}  # rank 0 waits 3.5 ms (7%) more
    assert rule_straggler(JobFacts(ranks, "compute")) is not None  # data parallel: named
    piped = JobFacts(ranks, "compute", {0: 15.5, 1: 12.0})
    assert rule_straggler(piped) is None
    f = rule_pipeline_bubble(piped)
    assert f is not None and f.kind == "pipeline-bubble"
    slow = {0: times(50, 22), 1: times(50, 12, forward=13)}  # 20%: the slower stage is named
    found = rule_straggler(JobFacts(slow, "compute", {0: 22.0, 1: 12.0}))
    assert found is not None and "rank 1" in found.evidence[0]


def test_a_pipeline_bubble_on_nccl_is_the_compute_streams_wait() -> None:
    """On NCCL the host only posts a stage's send/recv (~0 ms); the compute stream waits. Where
    steps were sampled for CUDA events the bubble is that device wait (9.1 ms a step on an
    H200 where the host read ~0), over the sampled steps; elsewhere the host's."""
    from types import SimpleNamespace

    from torchtop.contract.logcodes import PIPELINE
    from torchtop.monitor.diagnosis.bubble import rank_bubble
    from torchtop.monitor.model.steps import StepRecord

    ms = 1_000_000
    steps = []
    for i in range(20):
        s = StepRecord(
            i, 100.0 + i * 0.02, 14 * ms, {"forward": 2 * ms, "comm": ms}, comm_groups={PIPELINE: 50_000}
        )
        if i % 4 == 0:  # sampled for CUDA events: the compute stream waited 9 ms in the schedule's wait
            s.device_ms = {"step": 14.0, "comm": 9.2, "forward": 1.6}
            s.device_groups = {PIPELINE: 9.0}
        steps.append(s)
    member = SimpleNamespace(state=SimpleNamespace(agent_time=100.5, steps=steps))
    assert rank_bubble(member, 60.0) == 9.0  # type: ignore[arg-type]
    for s in steps:  # on gloo (no CUDA events): the host's wait
        s.device_ms, s.device_groups = {}, {}
    assert abs((rank_bubble(member, 60.0) or 0.0) - 0.05) < 1e-9  # type: ignore[arg-type]


def test_the_collectives_wait_does_not_displace_a_larger_cause_of_the_same_severity() -> None:
    """An mp.spawn DDP job whose loss runs outside the timed phases (over half the step) beside a
    comm wait of 21%: the larger cause is the headline, and holds; the wait is the headline where
    it is the larger (a regression test: the job rules weigh the aggregate's verdict)."""
    job = JobState()
    per = {
        r: rank_steps(r, step_ms=38.0, data=0.5, forward=4.0, backward=5.0, optimizer=0.5, comm=8.0)
        for r in (0, 1)
    }
    feed(job, per)
    d, s = diagnose_job(job)
    assert s is None and d.verdict.kind == "outside-phases", d.verdict
    d2, _ = diagnose_job(job, d)  # held, with the verdict in force
    assert d2.verdict.kind == "outside-phases"
    comm = JobState()
    feed(
        comm,
        {
            r: rank_steps(r, step_ms=38.0, data=0.5, forward=4.0, backward=5.0, optimizer=0.5, comm=20.0)
            for r in (0, 1)
        },
    )
    assert diagnose_job(comm)[0].verdict.kind == "communication"
