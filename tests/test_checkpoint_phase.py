"""Saves as the `checkpoint` phase: torch.save and DCP's save / async save timed on the training
thread (agent/hooks/checkpoint.py), replayed (monitor/model/replay.py), judged (the `checkpoint`
verdict and its what-if: monitor/diagnosis/checkpoint.py); an older log or relay second without
the phase still reads (0)."""

from __future__ import annotations

import io
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tests.agent_util import diagnosed
from torchtop.contract import logcodes as lc
from torchtop.contract.relay import Second
from torchtop.monitor.diagnosis.checkpoint import Saving, checkpoint_upside, rule_checkpoint, saving
from torchtop.monitor.diagnosis.facts import Facts
from torchtop.monitor.model.fmt import pct
from torchtop.monitor.model.hotspots import _phase_name  # pyright: ignore[reportPrivateUsage]
from torchtop.monitor.model.rank_stats import RankStats, slots
from torchtop.monitor.model.replay import StepRecorder
from torchtop.monitor.model.step_pack import to_record
from torchtop.monitor.model.steps import StepRecord

S = lc.SHIFT


def _replay(entries: list[int]) -> list[StepRecord]:
    return [to_record(raw, 0.0, 0) for raw in StepRecorder().feed(entries)]


# -- the log -------------------------------------------------------------------------------------
def test_a_save_is_the_checkpoint_phase_on_a_timed_step_and_counted_on_an_untimed_one() -> None:
    steps = _replay(
        [
            1000 << S | lc.BOUNDARY,
            1100 << S | lc.DATA,
            1200 << S | lc.EXIT | lc.DATA,
            1300 << S | lc.SAVE,
            1700 << S | lc.EXIT | lc.SAVE,
            2000 << S | lc.BOUNDARY,
            2100 << S | lc.SAVE,  # an untimed step (phase sampling): its save is still counted
            2400 << S | lc.EXIT | lc.SAVE,
            3000 << S | lc.UNTIMED_END,
        ]
    )
    timed, untimed = steps
    assert timed.phases["checkpoint"] == 400 and timed.phases["other"] == 1000 - 100 - 400
    assert sum(timed.phases.values()) == timed.wall_ns
    assert (timed.saves, timed.saved_ns) == (1, 400)
    assert untimed.phases == {} and (untimed.saves, untimed.saved_ns) == (1, 300)


def test_a_log_without_saves_reads_checkpoint_0_and_a_sample_phase_6_is_still_other() -> None:
    (s,) = _replay(
        [1000 << S | lc.BOUNDARY, 1100 << S | lc.DATA, 1200 << S | lc.EXIT | lc.DATA, 2000 << S | lc.BOUNDARY]
    )
    assert s.phases["checkpoint"] == 0 and s.saves == 0 and s.saved_ns == 0
    # stack samples recorded before the phase existed: 6 was `other`, and still is
    assert _phase_name(6) == "other" and _phase_name(lc.SAMPLE_CHECKPOINT) == "checkpoint"


def test_an_older_relays_second_reads_checkpoint_0_and_a_newer_one_carries_it() -> None:
    stats = RankStats()
    ns = 10_000_000
    stats.add([StepRecord(i, 100.0 + i * 0.01, ns, _phases(ns, 4_000_000)) for i in range(10)])
    (b,) = stats.levels[0]
    sent = b.second()
    assert sent.checkpoint_ns == 10 * 4_000_000
    assert stats.window(10.0).phases["checkpoint"] == pytest.approx(4.0)
    # an older relay's second: the list without the last field
    old = msgspec.msgpack.decode(_older(sent), type=Second)
    assert old.checkpoint_ns == 0.0 and old.data_ns == sent.data_ns and old.seq == sent.seq
    again = RankStats()
    again.put(int(old.t), slots(old))
    assert again.window(10.0).phases["checkpoint"] == 0.0
    assert again.window(10.0).phases["other"] == pytest.approx(stats.window(10.0).phases["other"])


def _older(s: Second) -> bytes:
    return msgspec.msgpack.encode(list(msgspec.structs.astuple(s))[:-1])


def _phases(wall: int, checkpoint: int) -> dict[str, int]:
    out = dict.fromkeys(lc.PHASES, 0)
    out["forward"] = wall - checkpoint
    out["checkpoint"] = checkpoint
    return out


# -- the verdict ---------------------------------------------------------------------------------
def _facts(s: Saving | None) -> Facts:
    step = s.step_ms if s else 10.0
    return Facts(steps=50, step_ms=step, shares={}, ms={}, checkpoint=s)


@pytest.mark.parametrize(
    ("share", "severity"), [(0.09, None), (0.10, "warning"), (0.29, "warning"), (0.30, "critical")]
)
def test_checkpoint_rule_bands(share: float, severity: str | None) -> None:
    f = _facts(Saving(5, share, 50.0, 10.0, 20.0))
    got = rule_checkpoint(f)
    assert (got.severity if got else None) == severity
    assert rule_checkpoint(_facts(None)) is None


def test_a_gpu_idle_while_the_host_saves_is_the_checkpoint_verdict_not_launch_overhead() -> None:
    """On an H200 a DCP async save every 10 steps held 94% of the step while NVML read the GPU 3%
    busy: the headline was host-overhead ("Python and kernel launches set the pace")."""
    from torchtop.monitor.diagnosis.selection import primary

    s = Saving(20, 0.94, 836.0, 10.0, 890.0)
    f = Facts(steps=200, step_ms=890.0, shares={"forward": 0.03, "other": 0.03}, ms={}, checkpoint=s)
    f.device, f.gpu_util, f.proc_cpu = "cuda", 3.0, 78.0
    assert primary(f, None).kind == "checkpoint"


def test_the_what_if_saves_ten_times_less_often_from_the_measured_cost_and_interval() -> None:
    # a save of 45 ms every 10 steps of 10 ms: 45 / 145 = 31% of wall time; every 100: 45 / 1045 = 4%
    steps = [StepRecord(i, i * 0.01, 10_000_000 + (45_000_000 if i % 10 == 0 else 0), {}) for i in range(50)]
    for s in steps:
        if s.i % 10 == 0:
            s.saves, s.saved_ns = 1, 45_000_000
    got = saving(steps)
    assert got is not None and got.saves == 5 and got.interval == 10
    assert got.share == pytest.approx(0.31, abs=0.005) and got.save_ms == pytest.approx(45.0)
    f = _facts(got)
    finding = rule_checkpoint(f)
    assert finding is not None and finding.kind == "checkpoint" and finding.severity == "critical"
    up = checkpoint_upside(f)
    assert up is not None
    assert "every 10 steps costs 31% of wall time; every 100 steps: 4%" in up.text, up.text
    assert up.speedup == pytest.approx(14.5 / 10.45, rel=0.01)


# -- the steps after an async save -----------------------------------------------------------------
def _after_saves(
    after_ms: float, save_ms: float = 2.0, every: int = 20, n: int = 100, ranks: int = 1, slowed: int = 0
) -> list[StepRecord]:
    """Steps of ~6 ms (a machine's jitter, and a pause now and then) saving every `every` steps
    (at step 0, 20, ...): the 5 after each save take `after_ms` (after the first `slowed` saves only,
    where given)."""
    out = []
    for rank in range(ranks):
        for i in range(n):
            wall = 6.0 + ((i * 7 + rank) % 5 - 2) * 0.1  # +-0.2 ms
            if i % 37 == 36:
                wall += 40.0  # a pause no save caused
            save = i % every == 0
            if 0 < i % every <= 5 and (not slowed or i // every < slowed):
                wall = after_ms + (wall - 6.0)
            s = StepRecord(i, i * 0.01, int((wall + (save_ms if save else 0.0)) * 1e6), {}, rank=rank)
            if save:
                s.saves, s.saved_ns = 1, int(save_ms * 1e6)
            out.append(s)
    return out


@pytest.mark.parametrize("ranks", [1, 2])  # a job's ranks' steps, pooled
def test_async_staging_that_slows_the_next_steps_is_named_and_costed(ranks: int) -> None:
    """NVIDIA-NeMo/Automodel #3131: async staging made the steps after a save ~10x slower, while
    the save call itself returned at once."""
    s = saving(_after_saves(14.0, ranks=ranks))
    assert s is not None and s.after == 5
    assert s.after_ms == pytest.approx(14.0, abs=0.25) and s.far_ms == pytest.approx(6.0, abs=0.25)
    assert s.extra_ms == pytest.approx(5 * 8.0, rel=0.05)  # 5 steps 8 ms slower each save
    # the saves alone are 1% of wall time; with the steps after them, about a quarter
    wall = 100 * 6.0 + 5 * 2.0 + 25 * 8.0 + 2 * 40.0  # steps, saves, 25 steps after, 2 pauses
    assert s.share == pytest.approx(10 / wall) and s.cost_share == pytest.approx(210 / wall, rel=0.02)
    finding = rule_checkpoint(_facts(s))
    assert finding is not None and finding.severity == "warning" and finding.share == s.cost_share
    # the save is cheap, the steps after it are not: that comes first
    assert finding.evidence[0].startswith("the 5 steps after each save run 2.3x slower (14.0 ms vs 6.00 ms)")
    assert "staging" in finding.evidence[0] and "42.0 ms a save in all" in finding.evidence[0]
    assert (
        "2.00 ms each" in finding.evidence[1]
        and "40.0 ms more in the steps after each" in finding.evidence[1]
    )
    assert any("PROCESS" in a for a in finding.advice)
    # the what-if moves the slowdown with the save: every 200 steps, 42 ms a save over ~6 ms steps
    up = checkpoint_upside(_facts(s))
    assert up is not None and f"costs {pct(s.cost_share, 0)} of wall time; every 200 steps: 3%" in up.text


def test_a_slowdown_after_saves_that_lands_outside_the_phases_is_the_checkpoints() -> None:
    """The steps a save slows count in `other` when the contention falls outside the timed phases:
    the outside-phases rule stands aside for the checkpoint verdict, which holds that time."""
    from torchtop.monitor.diagnosis.selection import primary
    from torchtop.monitor.diagnosis.verdicts import rule_outside

    s = saving(_after_saves(30.0, every=10))
    assert s is not None and s.extra_share > 0.3
    shares = {"forward": 0.35, "other": s.extra_share + 0.02}
    f = Facts(steps=100, step_ms=s.step_ms, shares=shares, ms={"forward": 4.0}, checkpoint=s)
    f.device = "cpu"
    without = Facts(steps=100, step_ms=s.step_ms, shares=shares, ms={"forward": 4.0}, checkpoint=None)
    without.device = "cpu"
    assert rule_outside(without) is not None  # the same shares, no saves: outside the phases
    assert rule_outside(f) is None
    assert primary(f, None).kind == "checkpoint"


def test_steps_after_a_save_no_slower_than_the_noise_say_nothing_more() -> None:
    for after in (6.0, 6.3):  # as fast, or slower by less than twice the spread of the far steps
        s = saving(_after_saves(after, save_ms=20.0))
        assert s is not None and (s.after, s.extra_ms, s.extra_share) == (0, 0.0, 0.0), after
        assert s.cost_share == s.share and s.cost_ms == s.save_ms
        finding = rule_checkpoint(_facts(s))
        assert (
            finding is not None
            and len(finding.evidence) == 1
            and "more in the steps" not in finding.evidence[0]
        )


def test_one_slow_stretch_after_a_single_save_is_not_the_saves() -> None:
    s = saving(_after_saves(14.0, slowed=1))  # after the first of 5 saves only
    assert s is not None and s.extra_ms == 0.0


def test_saves_too_close_for_steps_far_from_one_are_not_compared() -> None:
    s = saving(_after_saves(14.0, every=2))  # every other step: none is far from a save
    assert s is not None and s.after == 0 and s.extra_ms == 0.0


# -- real torch on CPU ---------------------------------------------------------------------------
torch = pytest.importorskip("torch")


def _wait_patched(fn_of: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if getattr(getattr(fn_of(), "__code__", None), "co_filename", "").startswith("<torchtop"):  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError("not patched by the agent tick")


def _big_state() -> dict[str, object]:
    return {"w": torch.randn(1 << 21)}  # 8 MiB: a save costs a large, known share of a small step


@pytest.mark.usefixtures("one_thread_warm_torch")
def test_a_loop_that_saves_every_5_steps_gets_the_checkpoint_verdict_within_5_points() -> None:
    import torchtop.agent as ta
    from tests.agent_util import mlp, snapshot_steps

    assert ta.start() is not None
    model, big = mlp(), _big_state()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
    n, every = 60, 5
    walls, saved = [], []
    for i in range(n):
        t = time.perf_counter_ns()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        s = 0
        if i % every == 0:
            t1 = time.perf_counter_ns()
            torch.save(big, io.BytesIO())  # before the optimizer: the save is this step's
            s = time.perf_counter_ns() - t1
        opt.step()
        opt.zero_grad()
        walls.append(time.perf_counter_ns() - t)
        saved.append(s)
    steps = snapshot_steps(ta.current(), n)
    assert [s.i for s in steps] == list(range(n))
    assert [s.saves for s in steps] == [1 if i % every == 0 else 0 for i in range(n)]
    # the save's own time, less the microseconds the script's clock adds around the wrapper: in
    # all, and each save most of it (a loaded machine may preempt the script between the clocks)
    got = [(s.i, s.phases["checkpoint"], saved[s.i]) for s in steps if saved[s.i]]
    assert sum(g for _, g, _ in got) >= 0.9 * sum(t for _, _, t in got), got
    assert not [(i, g, t) for i, g, t in got if g < 0.5 * t], got

    d = diagnosed(steps)
    judged = range(n - d.steps, n)
    truth = sum(saved[i] for i in judged) / sum(walls[i] for i in judged)
    assert d.verdict.kind == "checkpoint", d.verdict
    assert abs(d.verdict.share - truth) <= 0.05, (d.verdict.share, truth)
    assert d.verdict.upside is not None and f"every {every} steps costs" in d.verdict.upside.text
    ta.stop()
    assert not getattr(torch.save.__code__, "co_filename", "").startswith("<torchtop")  # undone


@pytest.mark.usefixtures("one_thread_warm_torch")
def test_dcp_save_and_async_saves_staging_and_wait_are_timed_and_another_threads_save_is_not(
    tmp_path: Path,
) -> None:
    import torchtop.agent as ta
    from tests.agent_util import mlp, snapshot_steps

    assert ta.start() is not None
    import torch.distributed.checkpoint  # noqa: F401 - what the agent tick looks for
    import torch.distributed.checkpoint.state_dict_saver as dcp  # dcp.save, as torch exports it

    _wait_patched(lambda: dcp.save)
    _wait_patched(lambda: dcp.async_save)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
    other = threading.Thread(target=lambda: [torch.save(_big_state(), io.BytesIO()) for _ in range(3)])
    pending = None
    for i in range(12):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if i == 2:
            dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "sync"), no_dist=True)
        if i == 4:
            pending = dcp.async_save(
                {"model": model.state_dict()}, checkpoint_id=str(tmp_path / "a"), no_dist=True
            )
        if i == 6:
            assert pending is not None
            fut: Any = getattr(pending, "upload_completion", pending)
            fut.result()  # the wait on the upload: this step's
        if i == 8:
            other.start()
            other.join()
        opt.step()
        opt.zero_grad()
    steps = snapshot_steps(ta.current(), 12)
    by_i = {s.i: s for s in steps}
    assert by_i[2].saves == 1 and by_i[2].phases["checkpoint"] > 0  # once, whatever dcp calls inside
    assert by_i[4].saves == 1 and by_i[4].phases["checkpoint"] > 0  # the staging
    assert by_i[6].saves == 1  # the wait
    assert by_i[8].saves == 0 and by_i[8].phases["checkpoint"] == 0  # another thread's saves
    assert sum(s.saves for s in steps) == 3
    assert (tmp_path / "sync").exists() and (tmp_path / "a").exists()


def test_two_saves_in_one_step_are_one_checkpoint_of_the_loops_every_n_steps() -> None:
    """DCP's async_save and the wait on the one before it (or a model's and an optimizer's
    torch.save) land in one step: an H200 run saving every 10 steps read "every 5 steps"."""
    steps = [StepRecord(i, i * 0.01, 10_000_000, {}) for i in range(100)]
    for s in steps[9::10]:
        s.saves, s.saved_ns, s.wall_ns = 2, 40_000_000, 50_000_000
    got = saving(steps)
    assert got is not None and got.saves == 10 and got.interval == pytest.approx(10.0)
    assert got.save_ms == pytest.approx(40.0)


@pytest.mark.usefixtures("one_thread_warm_torch")
def test_the_steps_slowed_after_each_dcp_async_save_are_named_in_the_verdict(tmp_path: Path) -> None:
    """The real path (agent, replay, window, verdict) of a loop whose 5 steps after each async
    save run slower: here their forward sleeps, where staging would contend with it (a contention
    made on purpose on CPU, through the GIL, was too erratic to test)."""
    import torchtop.agent as ta
    from tests.agent_util import mlp, snapshot_steps

    assert ta.start() is not None
    import torch.distributed.checkpoint  # noqa: F401 - what the agent tick looks for
    import torch.distributed.checkpoint.state_dict_saver as dcp

    _wait_patched(lambda: dcp.async_save)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
    n, every = 100, 20
    pending: Any = None  # a Future, or an AsyncSaveResponse holding two
    since = every
    # the contention: the forward of the 5 steps after a save is slower (a layer inside it sleeps)
    model[0].register_forward_hook(lambda *_: time.sleep(0.004) if 0 < since <= 5 else None)
    for i in range(n):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if i % every == every // 2:
            if pending is not None:
                getattr(pending, "upload_completion", pending).result()  # the one before: written since
            pending, since = (
                dcp.async_save(
                    {"model": model.state_dict()}, checkpoint_id=str(tmp_path / str(i)), no_dist=True
                ),
                0,
            )
        opt.step()
        opt.zero_grad()
        since += 1
    assert pending is not None
    getattr(pending, "upload_completion", pending).result()
    steps = snapshot_steps(ta.current(), n)
    assert [s.i for s in steps if s.saves] == list(range(every // 2, n, every))
    d = diagnosed(steps)
    assert d.verdict.kind == "checkpoint", d.verdict
    line = next((e for e in d.verdict.evidence if e.startswith("the 5 steps after each save run")), None)
    assert line is not None, d.verdict.evidence
    s = saving(steps[n - d.steps :])
    assert s is not None and s.after_ms > 2 * s.far_ms and s.extra_ms > 5 * 3.0, s  # 5 steps, 4 ms each
    assert d.verdict.share == pytest.approx(s.cost_share) and s.cost_share > s.share


@pytest.mark.usefixtures("one_thread_warm_torch")
def test_a_frameworks_save_method_is_timed_whole_once_and_undone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's Trainer.save_checkpoint writes the file after a torch.save into memory: the
    whole method is the save (found by module name, as the agent tick finds it), timed once."""
    import types

    import torchtop.agent as ta
    from tests.agent_util import mlp, snapshot_steps

    class Trainer:
        def save_checkpoint(self, filepath: str, weights_only: bool | None = None) -> None:
            torch.save(_big_state(), io.BytesIO())
            time.sleep(0.02)  # the file write

    mod = types.ModuleType("fake_lightning_trainer")
    mod.Trainer = Trainer  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "lightning.pytorch.trainer.trainer", mod)
    orig = Trainer.__dict__["save_checkpoint"]
    assert ta.start() is not None
    assert Trainer.__dict__["save_checkpoint"] is not orig  # patched at start: already imported
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
    for i in range(6):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if i == 3:
            Trainer().save_checkpoint("x.ckpt")
        opt.step()
        opt.zero_grad()
    steps = snapshot_steps(ta.current(), 6)
    assert [s.saves for s in steps] == [0, 0, 0, 1, 0, 0]
    assert steps[3].phases["checkpoint"] >= 20_000_000  # the write too, not only the torch.save
    ta.stop()
    assert Trainer.__dict__["save_checkpoint"] is orig
