"""A rank's work per step and its verdict inside a job: pure rules and the replay, no job.

The straggler is either given more work (one rank's sequences twice as long: work imbalance,
balance the packing) or slower at the same work (its GPU or host). A rank that waits for the
straggler says so in its own verdict, never sync or host overhead; the straggler's own line is
the job's verdict; ranks doing the same work read the same.
"""

from __future__ import annotations

import msgspec
import pytest

from torchtop.contract.logcodes import BOUNDARY, COMM, EXIT, FORWARD, FORWARD_START, SHIFT, WORK
from torchtop.monitor.diagnosis.facts import Diagnosis, Finding, Severity
from torchtop.monitor.diagnosis.in_job import rank_diagnosis
from torchtop.monitor.diagnosis.straggler import find_straggler, straggler_finding
from torchtop.monitor.model.rank_stats import RankStats, RankTimes, Work
from torchtop.monitor.model.replay import StepRecorder
from torchtop.monitor.model.step_pack import to_record


def _at(t: int, code: int) -> int:
    return t << SHIFT | code


def times(step: float, comm: float, work: Work | None = None, **phases: float) -> RankTimes:
    base = {"data": 1.0, "h2d": 0.0, "forward": 3.0, "backward": 5.0, "optimizer": 1.0, "comm": comm}
    base.update(phases)
    base["other"] = max(0.0, step - sum(base.values()))
    return RankTimes(100, step, 100, base, 0, {}, work)


def test_work_entries_add_up_over_micro_batches_and_reach_the_rank_stats() -> None:
    log = [
        _at(100, BOUNDARY),
        _at(110, FORWARD_START + 3),
        (_at(111, WORK), 8, 128, 16),
        _at(120, EXIT | FORWARD),
        _at(130, FORWARD_START + 3),
        (_at(131, WORK), 8, 256, 32),
        _at(140, EXIT | FORWARD),
        _at(150, BOUNDARY),
    ]
    (raw,) = StepRecorder().feed(log)
    rec = to_record(raw, 1000.0, 0)
    assert (rec.samples, rec.tokens, rec.seq) == (16, 384, 32)
    stats = RankStats()
    stats.add([rec])
    assert stats.window(10).work == Work(16, 384, 32)


def test_a_wait_nested_in_forward_is_comm_and_leaves_forward_its_compute() -> None:
    """FSDP2's all-gather wait (Work.wait) inside a forward: the forward keeps only its compute."""
    log = [
        _at(100, BOUNDARY),
        _at(110, FORWARD_START + 3),
        _at(120, COMM),
        _at(170, EXIT | COMM),
        _at(180, EXIT | FORWARD),
        _at(200, BOUNDARY),
    ]
    (raw,) = StepRecorder().feed(log)
    phases = to_record(raw, 0.0, 0).phases
    assert phases["comm"] == 50 and phases["forward"] == 20


def test_more_tokens_is_work_imbalance_not_a_slow_rank() -> None:
    same = Work(8, 64, 8)
    ranks = {r: times(60, 40, same, forward=5, backward=10) for r in range(4)}
    ranks[3] = times(60, 10, Work(8, 128, 16), forward=15, backward=30)
    s = find_straggler(ranks)
    assert s is not None and s.rank == 3 and s.imbalance
    assert s.work_ratio == pytest.approx(2.0)
    f = straggler_finding(s)
    assert f.kind == "work-imbalance"
    assert (
        f.evidence[0]
        == "rank 3 processes 2.0x the median rank's tokens (sequence 16 vs 8): balance the packing"
    )
    assert "pack" in f.advice[0]


def test_the_same_work_slower_is_a_straggler_at_the_same_work() -> None:
    same = Work(8, 64, 8)
    ranks = {r: times(60, 40, same, backward=10) for r in range(4)}
    ranks[1] = times(60, 10, Work(8, 66, 8), backward=40)
    s = find_straggler(ranks)
    assert s is not None and s.rank == 1 and not s.imbalance
    f = straggler_finding(s)
    assert f.kind == "straggler"
    assert any("slower at the same work" in e for e in f.evidence), f.evidence


def test_without_batches_seen_nothing_is_said_about_work() -> None:
    ranks = {r: times(60, 40, backward=10) for r in range(4)}
    ranks[1] = times(60, 10, backward=40)
    s = find_straggler(ranks)
    assert s is not None and s.work_ratio is None
    f = straggler_finding(s)
    assert f.kind == "straggler" and not any("work" in e for e in f.evidence)


def _own(kind: str, severity: Severity = "critical") -> Diagnosis:
    return Diagnosis(Finding(kind, severity, 0.5, (f"{kind} evidence",)), (), 50)


def test_ranks_waiting_for_the_straggler_say_so() -> None:
    ranks = {r: times(60, 40, backward=10) for r in range(4)}
    ranks[2] = times(60, 10, backward=40)
    s = find_straggler(ranks)
    assert s is not None
    job = Diagnosis(straggler_finding(s), (), 50)
    lines = {r: rank_diagnosis(_own("sync" if r else "host-overhead"), r, job, s, ranks) for r in ranks}
    assert lines[2].verdict == job.verdict  # the straggler's own line is the job's
    for r in (0, 1, 3):
        v = lines[r].verdict
        assert v.kind == "waiting"
        assert v.evidence[0].startswith("waiting for rank 2 (30.0 ms a step)"), v.evidence
        assert "sync" not in " ".join(v.evidence) and "idle" not in " ".join(v.evidence)
        assert "rank 2" in v.advice[0]


def test_identical_ranks_read_the_same_without_a_straggler() -> None:
    ranks = {r: times(60, 6, backward=20) for r in range(4)}
    job = Diagnosis(Finding("communication", "info", 0.1, ("every rank waits",)), (), 50)
    assert find_straggler(ranks) is None
    got = {
        0: rank_diagnosis(
            _own("host-overhead", "warning"), 0, job, None, ranks
        ),  # a collective wait, not overhead
        1: rank_diagnosis(_own("compute", "ok"), 1, job, None, ranks),
        2: rank_diagnosis(_own("sync", "critical"), 2, job, None, ranks),
    }
    assert {d.verdict.kind for d in got.values()} == {"communication"}
    # a rank whose figures really differ keeps its own
    data = rank_diagnosis(_own("data-loading", "critical"), 3, job, None, ranks)
    assert data.verdict.kind == "data-loading"


def test_the_agent_logs_each_timed_steps_batch(agent) -> None:
    """Real torch on CPU: sequences of 12 tokens, 4 a batch, then token ids with keyword input."""
    torch = pytest.importorskip("torch")
    from tests.agent_util import mlp, snapshot_steps

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(10):
        x = torch.randn(4, 12, 32)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    steps = snapshot_steps(agent, 10)
    timed = [s for s in steps if s.phases and s.i >= 1]  # step 0 finds the root (a one-shot hook)
    assert timed and all((s.samples, s.tokens, s.seq) == (4, 48, 12) for s in timed), [
        (s.samples, s.tokens, s.seq) for s in timed
    ]


def test_shape_work_reads_tokens_only_where_there_is_a_sequence() -> None:
    torch = pytest.importorskip("torch")
    from torchtop.agent.hooks.work import shape_work

    assert shape_work(torch.zeros(8, 512, dtype=torch.long)) == (8, 4096, 512)  # token ids
    assert shape_work(torch.zeros(8, 16, 64)) == (8, 128, 16)  # activations
    assert shape_work(torch.zeros(8, 3, 32, 32)) == (8, 0, 0)  # images: samples only
    assert shape_work(torch.zeros(8, 64)) == (8, 0, 0)  # features
    assert shape_work(torch.tensor(1.0)) is None


def test_a_named_collective_counts_for_its_group_with_its_nested_wait() -> None:
    """COMM (the collective), COMM_GROUP, a nested COMM (its Work.wait), the exits: the group
    gets the outer span; a bare Work.wait (no group) adds to comm only."""
    from torchtop.contract.logcodes import COMM_GROUP

    log = [
        _at(100, BOUNDARY),
        _at(110, COMM),
        (_at(111, COMM_GROUP), "tp"),
        _at(112, COMM),
        _at(140, EXIT | COMM),
        _at(141, EXIT | COMM),
        _at(150, COMM),
        _at(160, EXIT | COMM),
        _at(200, BOUNDARY),
    ]
    (raw,) = StepRecorder().feed(log)
    rec = to_record(raw, 0.0, 0)
    assert rec.phases["comm"] == 41
    assert rec.comm_groups == {"tp": 30}


def test_collectives_are_split_by_the_device_meshs_group(agent) -> None:
    """A real (one-rank) gloo group and a device mesh named dp: its collectives count for dp (a
    mesh that spans the world reuses the default group: that is dp too); another group by its name."""
    torch = pytest.importorskip("torch")
    dist = torch.distributed
    from tests.agent_util import free_port, mlp, snapshot_steps

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
        group = mesh.get_group("dp")
        other = dist.new_group([0], group_desc="experts")
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(8):
            loss = model(torch.randn(4, 32)).pow(2).mean()
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad, group=group)
            dist.all_reduce(torch.ones(1))  # the default group: the mesh's too
            dist.all_reduce(torch.ones(1), group=other)
            opt.step()
            opt.zero_grad()
        steps = [s for s in snapshot_steps(agent, 8) if s.phases]
    finally:
        dist.destroy_process_group()
    assert steps and all(set(s.comm_groups) == {"dp", "experts"} for s in steps), [
        s.comm_groups for s in steps
    ]
    assert all(sum(s.comm_groups.values()) <= s.phases["comm"] for s in steps)


def test_a_ranks_work_and_live_throughput_in_the_report() -> None:
    from torchtop.monitor.diagnosis.job_diagnosis import work_json

    t = times(50.0, 5.0, Work(8, 1024, 128))
    assert msgspec.to_builtins(work_json(t)) == {
        "samples": 8,
        "tokens": 1024,
        "seq": 128,
        "samples_per_s": 160.0,
        "tokens_per_s": 20480.0,
    }
    untokened = work_json(times(50.0, 5.0, Work(8, 0, 0)))
    assert untokened is not None and untokened.tokens_per_s is None
    assert work_json(times(50.0, 5.0)) is None
