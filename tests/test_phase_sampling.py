"""Phase sampling: on fast steps the agent times the phases of a random sample of steps, and
every step's end.

Timing a step's phases costs the training thread ~20 us (cold caches: docs/benchmarks.md), 1%
of a 2 ms step. So on steps under 20 ms only about 20 ms / step time of them are timed (1 in
10 at 2 ms), in random runs, and the others log their end alone (UNTIMED_END).
These tests run real CPU loops with the default policy and check what a user relies on: every
step is counted with its wall time, the breakdown of the timed ones is the run's, an
evaluation loop that starts in an untimed stretch is still seen as evaluation.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("torch")
import torch  # noqa: E402  # a module, not a variable: its classes annotate below

import torchtop.agent as ta  # noqa: E402
from tests.agent_util import snapshot_steps, waited  # noqa: E402
from torchtop.agent.hooks import phase_sampling  # noqa: E402
from torchtop.agent.hooks import probe as probe_mod  # noqa: E402
from torchtop.contract import logcodes  # noqa: E402
from torchtop.monitor.model.state import breakdown  # noqa: E402

pytestmark = pytest.mark.phase_sampling  # the default policy, end to end


@pytest.fixture
def stopped():
    yield
    ta.stop()


def _mlp() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _train(
    model: torch.nn.Module, opt: torch.optim.Optimizer, batches, waits: list[int] | None = None
) -> None:
    for x, y in waited(batches, [] if waits is None else waits):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


class _Sleepy(torch.utils.data.Dataset):
    """A batch of 8 rows per item; every `every`-th item sleeps `ms` (a loader's periodic stall)."""

    def __init__(self, n: int, every: int, ms: float) -> None:
        self.n, self.every, self.ms = n, every, ms
        self.x, self.y = torch.randn(8, 32), torch.randint(0, 4, (8,))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i % self.every == 0:
            time.sleep(self.ms / 1000)
        return self.x, self.y


def _loader(n: int, every: int, ms: float) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(_Sleepy(n, every, ms), batch_size=None, shuffle=False)


def _expected_share(steps: list) -> float:
    """The share of `steps` the policy times: min(1, step time / FULL_STEP_NS), at least
    1 / MAX_ONE_IN, over each housekeeping period of their wall times."""
    period = probe_mod.PERIOD
    shares = []
    for k in range(0, len(steps), period):
        block = steps[k : k + period]
        mean_ns = sum(s.wall_ns for s in block) / len(block)
        shares.append(min(1.0, max(1 / phase_sampling.MAX_ONE_IN, mean_ns / phase_sampling.FULL_STEP_NS)))
    return sum(shares) / len(shares)


@pytest.mark.slow  # a 3000-step real loop
def test_fast_steps_are_all_counted_and_a_sample_is_timed(stopped) -> None:
    agent = ta.start()
    assert agent is not None
    model, opt = _mlp()
    _train(model, opt, _loader(3000, 10**9, 0))  # ~0.3 ms steps, no sleeps
    steps = snapshot_steps(agent, 3000)
    assert [s.i for s in steps] == list(range(3000))  # every step, in order, none lost
    assert all(s.wall_ns > 0 for s in steps)
    timed = [s for s in steps if s.phases]
    untimed = [s for s in steps if not s.phases]
    assert all(s.phases for s in steps[: probe_mod.FIRST_STEPS])  # the start is timed in full
    # about 1 step in (20 ms / step time), at least 1 in 64: ~1 in 64 of ~0.3 ms steps on an idle
    # machine, more where a loaded one makes them longer. The share expected from the steps' own
    # wall times, period by period as the policy draws them:
    expected = _expected_share(steps[probe_mod.FIRST_STEPS :])
    assert 0.4 * expected <= len(timed) / len(steps) <= 2.5 * expected + 0.02, (len(timed), expected)
    for s in timed:
        assert s.phases["forward"] > 0 and s.phases["backward"] > 0 and s.phases["optimizer"] > 0
        assert sum(s.phases.values()) == s.wall_ns  # they add up, `other` the rest
        assert s.micro == 1
    assert all(s.micro == 0 and not s.device_ms for s in untimed)
    if expected > 0.5:
        return  # a machine so loaded that most steps take 5 ms or more: few untimed runs to look at
    # untimed runs are random: not one stride
    runs, n = set(), 0
    for s in steps[probe_mod.FIRST_STEPS :]:
        if s.phases:
            if n:
                runs.add(n)
            n = 0
        else:
            n += 1
    assert len(runs) >= 5, runs


@pytest.mark.slow  # long real loops
def test_every_step_is_timed_on_request_or_when_steps_are_long(stopped) -> None:
    agent = ta.start(phase_every=1)
    assert agent is not None
    model, opt = _mlp()
    _train(model, opt, _loader(400, 10**9, 0))
    steps = snapshot_steps(agent, 400)
    assert len(steps) == 400 and all(s.phases for s in steps)
    ta.stop()
    agent = ta.start()
    assert agent is not None
    long_ms = phase_sampling.FULL_STEP_NS / 1e6 + 1
    _train(model, opt, _loader(80, 1, long_ms))  # steps longer than FULL_STEP_NS
    steps = snapshot_steps(agent, 80)
    assert len(steps) == 80 and all(s.phases for s in steps)


@pytest.mark.slow  # a 2400-step real loop
def test_the_timed_steps_breakdown_is_the_runs_own_with_periodic_stalls(stopped) -> None:
    """A loader that stalls on every 4th batch (as 4 workers would) and 1 timed step in ~4:
    a fixed stride of 4 would see every stall or none; random runs see a quarter of them."""
    agent = ta.start(phase_every=4)
    assert agent is not None
    model, opt = _mlp()
    waits: list[int] = []
    t0 = time.perf_counter_ns()
    _train(model, opt, _loader(2400, 4, 3.0), waits)
    total = time.perf_counter_ns() - t0
    steps = snapshot_steps(agent, 2400)
    assert len(steps) == 2400
    timed = [s for s in steps if s.phases]
    assert 0.15 * len(steps) <= len(timed) <= 0.4 * len(steps), len(timed)
    true_share = sum(waits) / total  # the data wait of every step, timed by this test
    got = breakdown(steps)["data"]
    assert true_share > 0.02  # the stalls are a real part of the step (~80% of it on an idle machine)
    assert abs(got - true_share) <= 0.25 * true_share, (got, true_share)
    stalled = sum(1 for s in timed if s.phases["data"] > 2_000_000)
    assert 0.12 * len(timed) <= stalled <= 0.4 * len(timed), (stalled, len(timed))


@pytest.mark.slow  # waits out the idle timeout
def test_an_eval_loop_that_starts_untimed_is_seen_as_eval(stopped) -> None:
    agent = ta.start(phase_every=64)  # long untimed stretches: the loop below starts in one
    assert agent is not None
    model, opt = _mlp()
    _train(model, opt, _loader(300, 10**9, 0))
    trained = 300
    # which step a stretch ends on is the policy's draw (and a loaded machine's longer steps are
    # timed more often): train on, a few steps at a time, until the loop stands in one
    while not agent.probe.untimed and trained < 300 + 50 * 4:
        _train(model, opt, _loader(4, 10**9, 0))
        trained += 4
    assert agent.probe.untimed, "the training loop should have ended in an untimed stretch"
    model.eval()
    # the agent thread ends the stretch UNTIMED_IDLE_S after the last step end, to within two of
    # its quiet ticks (nobody subscribed): at most ~2 s in
    deadline = time.monotonic() + 4.0
    n = 0
    with torch.no_grad():
        while time.monotonic() < deadline:
            for x, _ in _loader(50, 1, 1.0):
                model(x)
                n += 1
    model.train()
    _train(model, opt, _loader(20, 10**9, 0))
    evals = snapshot_steps(agent, 100, kind="eval")
    train = snapshot_steps(agent, trained + 20)
    assert len(train) == trained + 20  # the training steps around it are all counted
    assert len(evals) >= n // 3, (len(evals), n)  # most of the eval iterations, once timed again
    timed = [s for s in evals if s.phases]
    assert len(timed) >= n // 3
    assert all(s.phases["data"] >= 0.9e6 for s in timed[1:-1])  # each holds its iteration's 1 ms load


@pytest.mark.slow
def test_short_eval_passes_are_one_eval_step_per_forward_whatever_the_timing(stopped) -> None:
    """Issue 18: 15 passes of 16 no-grad forwards, each pass far shorter than the 1 s after which
    an untimed stretch is timed again, counted 16 or 32 eval steps: a pass that began in an
    untimed stretch logged nothing and folded into the next training step."""
    agent = ta.start(phase_every=16)  # long untimed stretches: most passes start in one
    assert agent is not None
    model, opt = _mlp()
    held = _loader(16, 10**9, 0)
    for _ in range(15):
        model.train()
        _train(model, opt, _loader(40, 10**9, 0))
        model.eval()
        with torch.no_grad():
            for x, _ in held:
                model(x)
    train = snapshot_steps(agent, 600)
    evals = snapshot_steps(agent, 240, kind="eval")
    assert len(train) == 600
    assert len(evals) == 240
    assert len([s for s in train if s.phases]) < 0.5 * len(train)  # training is still sampled


@pytest.mark.slow
def test_a_teacher_forward_in_each_training_step_is_training(stopped) -> None:
    """One no-grad forward a step (a teacher, a target network) is part of the training step: it
    neither makes the step an eval step nor switches phase sampling off."""
    agent = ta.start(phase_every=8)
    assert agent is not None
    model, opt = _mlp()
    teacher, _ = _mlp()
    for x, _ in _loader(400, 10**9, 0):
        with torch.no_grad():
            target = teacher(x).softmax(1)
        loss = torch.nn.functional.cross_entropy(model(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    train = snapshot_steps(agent, 400)
    assert len(train) == 400
    assert snapshot_steps(agent, 0, timeout=0.5, kind="eval") == []
    timed = [s for s in train if s.phases]
    assert 0.05 * len(train) <= len(timed) <= 0.4 * len(train), len(timed)


def test_an_untimed_training_step_end_is_training_whatever_it_held() -> None:
    """UNTIMED_END only ever ends a training step (the optimizer's, or step()'s): a logged no-grad
    forward in it (a teacher's, or the last of an eval pass) does not make it an eval step."""
    from torchtop.monitor.model.replay import StepRecorder

    t = 1_000_000
    e = lambda code, dt: (t + dt) << logcodes.SHIFT | code  # noqa: E731
    rec = StepRecorder()
    out = rec.feed(
        [
            e(logcodes.BOUNDARY, 0),
            e(logcodes.FORWARD_START + 2, 100),  # root 1, no grad
            e(logcodes.EXIT | logcodes.FORWARD, 300),
            e(logcodes.UNTIMED_END, 1000),
            e(logcodes.FORWARD_START + 2, 1100),  # an eval pass: two no-grad forwards, then timed
            e(logcodes.EXIT | logcodes.FORWARD, 1200),
            e(logcodes.TIMING_RESUMED, 1300),
            e(logcodes.FORWARD_START + 2, 1300),
            e(logcodes.EXIT | logcodes.FORWARD, 1400),
            e(logcodes.DATA, 1500),
            e(logcodes.EXIT | logcodes.DATA, 1600),
            e(logcodes.FORWARD_START + 3, 1600),  # training again
            e(logcodes.EXIT | logcodes.FORWARD, 1700),
            e(logcodes.STEP_END, 2000),
        ]
    )
    assert [(r[1], r[3]) for r in out] == [("train", 1000), ("eval", 300), ("eval", 200), ("train", 500)]


def test_the_replay_keeps_wall_time_and_drops_phases_of_untimed_steps() -> None:
    from torchtop.monitor.model.replay import StepRecorder
    from torchtop.monitor.model.step_pack import to_record

    t = 1_000_000
    e = lambda code, dt: (t + dt) << logcodes.SHIFT | code  # noqa: E731
    rec = StepRecorder()
    out = rec.feed(
        [
            e(logcodes.BOUNDARY, 0),
            e(logcodes.FORWARD_START + 1, 100),
            e(logcodes.EXIT | logcodes.FORWARD, 300),  # a stray entry
            e(logcodes.UNTIMED_END, 1000),  # untimed: wall 1000, no phases
            e(logcodes.DATA, 1100),
            e(logcodes.EXIT | logcodes.DATA, 1400),
            e(logcodes.TIMING_RESUMED, 1500),
            e(logcodes.BACKWARD, 1600),
            e(logcodes.EXIT | logcodes.BACKWARD, 1700),
            e(logcodes.STEP_END, 2000),  # timing resumed inside it: untimed too
            e(logcodes.DATA, 2100),
            e(logcodes.EXIT | logcodes.DATA, 2500),
            e(logcodes.STEP_END, 3000),  # timed
        ]
    )
    records = [to_record(r, 0.0, 0) for r in out]
    assert [(r.i, r.wall_ns) for r in records] == [(0, 1000), (1, 1000), (2, 1000)]
    assert records[0].phases == {} and records[1].phases == {} and records[0].micro == 0
    assert records[2].phases["data"] == 400 and sum(records[2].phases.values()) == 1000
    assert breakdown(records)["data"] == pytest.approx(0.4)
