"""What the agent measures inside real CPU training loops: phases, data waits, steps and micro-batches.

Each test starts the in-process agent, trains, and reads the steps back over the agent's real
loopback sockets (the conftest fixture stops the agent afterwards). That the agent never gets in
the way is in test_agent_never_in_the_way.py, the replay of its log in test_probe_log_replay.py.
"""

from __future__ import annotations

import queue
import threading
import time

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import torchtop.agent as ta  # noqa: E402
from tests.agent_util import check_records, median, mlp, snapshot_steps, tensor_loader, train, waited  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_warm_torch")

MS = 1_000_000


# -- what it measures ----------------------------------------------------------------------------
def test_phases_add_up_on_an_mlp_loop() -> None:
    assert ta.start() is not None
    model = mlp()
    t, wall_before = time.perf_counter_ns(), time.time()
    n = train(model, tensor_loader(30))
    elapsed, wall_after = time.perf_counter_ns() - t, time.time()
    steps = snapshot_steps(ta.current(), n)

    assert n == 30
    assert [s.i for s in steps] == list(range(30))  # one record per optimizer step, in order
    check_records(steps)
    # no CUDA timing for a CPU loop: unless this process holds GPU memory (on a GPU machine, an
    # earlier test's), which is what turns the event sampling on
    gpu_in_use = (
        torch.cuda.is_available() and torch.cuda.is_initialized() and torch.cuda.memory_reserved() > 0
    )
    for s in steps:
        assert s.kind == "train" and s.micro == 1 and s.rank == 0
        assert s.device_ms == {} or gpu_in_use
        assert s.phases["forward"] > 0 and s.phases["backward"] > 0 and s.phases["optimizer"] > 0
        assert s.phases["data"] > 0
        assert s.phases["h2d"] == 0  # CPU: nothing crosses to a device
    # steps are contiguous: each starts where the previous ended, and together they cover the loop
    for a, b in zip(steps, steps[1:]):
        assert b.t0 == pytest.approx(a.t0 + a.wall_ns / 1e9, abs=1e-4)
    assert sum(s.wall_ns for s in steps) <= elapsed
    assert wall_before - 0.005 <= steps[0].t0 < steps[-1].t0 + steps[-1].wall_ns / 1e9 <= wall_after + 0.005


class SleepyBatches(Dataset):
    """Each item is a whole batch that takes `delay` seconds to produce."""

    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay
        self.made: list[int] = []  # ns each item took to make, timed inside (workers: not seen here)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i >= self.n:
            raise IndexError(i)
        t = time.perf_counter_ns()
        time.sleep(self.delay)
        batch = torch.randn(16, 32), torch.randint(0, 4, (16,))
        self.made.append(time.perf_counter_ns() - t)
        return batch


@pytest.mark.slow  # among the fast subset's slowest, ~1.3 s here (issue 27: the subset under 60 s)
def test_dataloader_wait_matches_a_known_sleep() -> None:
    delay = 0.030
    assert ta.start() is not None
    dataset, waits = SleepyBatches(25, delay), []
    n = train(mlp(), waited(DataLoader(dataset, batch_size=None, num_workers=0), waits))
    steps = snapshot_steps(ta.current(), n)
    assert len(steps) == n == 25
    check_records(steps)
    # nested intervals, whatever the machine's speed: making the batch lies inside the data
    # phase, which lies inside this loop's own next()
    for s, inner, outer in zip(steps, dataset.made, waits):
        assert inner <= s.phases["data"] <= outer, (inner / MS, s.phases["data"] / MS, outer / MS)
        assert s.phases["data"] >= delay * 1e9 * 0.98  # a sleep never ends early
    # the wait is data, not "other": the rest of the step is the tiny MLP's work
    assert median([s.phases["other"] for s in steps]) < 0.2 * median([s.phases["data"] for s in steps])


@pytest.mark.slow  # among the fast subset's slowest, ~0.8 s here (issue 27: the subset under 60 s)
def test_prefetch_thread_time_is_not_counted() -> None:
    """A loader iterated on a helper thread: its DataLoader time must not land in the steps.

    The helper spends 20 ms a batch, training 30 ms a step, so the queue is full and the
    training thread hardly waits: its data phase is that short wait, not the helper's 20 ms.
    """

    def prefetch(loader):
        q: queue.Queue = queue.Queue(maxsize=4)

        def work() -> None:
            for batch in loader:
                q.put(batch)
            q.put(None)

        threading.Thread(target=work, daemon=True).start()
        while (batch := q.get()) is not None:
            yield batch

    assert ta.start() is not None
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    n = 0
    for x, y in prefetch(DataLoader(SleepyBatches(15, 0.020), batch_size=None)):
        nn.functional.cross_entropy(model(x), y).backward()
        time.sleep(0.030)  # the training thread is the slow one: the queue stays full
        opt.step()
        opt.zero_grad()
        n += 1
    steps = snapshot_steps(ta.current(), n)
    assert len(steps) == n == 15
    check_records(steps)
    # the queue stays full: the data wait is a small share of each step, whatever the machine's speed
    assert median([s.phases["data"] / s.wall_ns for s in steps[2:]]) < 0.1
    assert all(s.phases["forward"] > 0 and s.phases["backward"] > 0 for s in steps)


def test_gradient_accumulation_is_one_step_per_optimizer_step() -> None:
    assert ta.start() is not None
    n = train(mlp(), tensor_loader(16), accumulate=2)
    steps = snapshot_steps(ta.current(), n)
    assert n == 8
    assert [s.i for s in steps] == list(range(8))
    assert [s.micro for s in steps] == [2] * 8
    check_records(steps)


def test_reentrant_checkpoint_is_one_micro_batch() -> None:
    """torch.utils.checkpoint(use_reentrant=True) runs a backward inside the backward."""
    from torch.utils.checkpoint import checkpoint

    assert ta.start() is not None
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in tensor_loader(6):
        h = checkpoint(model, x.requires_grad_(), use_reentrant=True)
        nn.functional.cross_entropy(h, y).backward()
        opt.step()
        opt.zero_grad()
    steps = snapshot_steps(ta.current(), 6)
    assert [s.micro for s in steps] == [1] * 6


@pytest.mark.parametrize(
    "auto", [pytest.param(True, marks=pytest.mark.slow), False]
)  # True: among the fast subset's slowest (issue 27: the subset under 60 s)
def test_explicit_step_and_phase_without_optimizer(auto: bool) -> None:
    assert ta.start(auto=auto) is not None
    model = mlp().eval()
    x = torch.randn(16, 32)
    for _ in range(12):
        with ta.step():
            with ta.phase("data"):
                time.sleep(0.004)
            with torch.no_grad(), ta.phase("forward"):
                model(x)
            with ta.phase("nonsense"):  # unknown: ignored, one warning
                pass
    # only no-grad forwards, no backward or optimizer: an evaluation loop, reported as eval
    steps = snapshot_steps(ta.current(), 12, kind="eval")
    assert [s.i for s in steps] == list(range(12))
    assert snapshot_steps(ta.current(), 0) == []  # nothing mixed into training steps
    check_records(steps)
    for s in steps:
        assert s.phases["data"] >= 4 * MS
        assert s.phases["forward"] > 0
        assert s.phases["backward"] == 0 and s.phases["optimizer"] == 0
        assert s.micro == 0


def test_explicit_steps_override_optimizer_boundaries() -> None:
    """Once step() is used, optimizer.step() no longer cuts steps (the user's boundaries win)."""
    assert ta.start() is not None
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = iter(tensor_loader(12))
    for _ in range(4):
        with ta.step():
            for _ in range(3):  # three optimizer steps inside one user step
                x, y = next(loader)
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
    steps = snapshot_steps(ta.current(), 4)
    assert len(steps) == 4
    check_records(steps)
    assert all(s.micro == 3 and s.phases["optimizer"] > 0 for s in steps)
