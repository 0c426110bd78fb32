"""The agent inside real CPU training loops: what it measures, and that it never gets in the way.

Each test starts the in-process agent, trains, and reads the steps back over the agent's real
loopback sockets (the conftest fixture stops the agent afterwards).
"""

from __future__ import annotations

import queue
import threading
import time
import types

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset, TensorDataset  # noqa: E402
from torch.utils.data import dataloader as dataloader_mod  # noqa: E402

import torchtop.agent as ta  # noqa: E402
from tests.agent_util import client_for, inner_step, median, snapshot_steps  # noqa: E402
from torchtop.agent import discovery, wire  # noqa: E402
from torchtop.agent import probe as probe_mod  # noqa: E402
from torchtop.agent.probe import MAX_FAILURES, Probe  # noqa: E402
from torchtop.agent.wire import BOUNDARY, EXIT, FORWARD_START, H2D_COPY, MARK, RESET, SHIFT  # noqa: E402
from torchtop.monitor.replay import BACKWARD, DATA, FORWARD, H2D, OPTIMIZER, StepRecorder  # noqa: E402

MS = 1_000_000


@pytest.fixture(scope="module", autouse=True)
def _one_thread_warm_torch():
    """One intra-op thread (the 2-core machines are shared) and torch's lazy imports done."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    train(mlp(), tensor_loader(2))
    yield
    torch.set_num_threads(threads)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4))


def tensor_loader(n_batches: int, batch_size: int = 16, **kw) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    ds = TensorDataset(torch.randn(n_batches * batch_size, 32, generator=g), torch.randint(0, 4, (n_batches * batch_size,), generator=g))
    return DataLoader(ds, batch_size=batch_size, **kw)


def train(model: nn.Module, loader, opt=None, accumulate: int = 1) -> int:
    """A plain loop, not changed for the agent; returns how many optimizer steps it took."""
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.05)
    steps = 0
    for k, (x, y) in enumerate(loader, 1):
        loss = nn.functional.cross_entropy(model(x), y) / accumulate
        loss.backward()
        if k % accumulate == 0:
            opt.step()
            opt.zero_grad()
            steps += 1
    return steps


def check_records(steps: list[wire.StepRecord]) -> None:
    """Invariants of every record: all phases present, they tile the wall time exactly."""
    for s in steps:
        assert set(s.phases) == set(wire.PHASES), s
        assert all(v >= 0 for v in s.phases.values()), s
        assert sum(s.phases.values()) == s.wall_ns, s
        assert s.wall_ns > 0


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
    gpu_in_use = torch.cuda.is_available() and torch.cuda.is_initialized() and torch.cuda.memory_reserved() > 0
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

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i >= self.n:
            raise IndexError(i)
        time.sleep(self.delay)
        return torch.randn(16, 32), torch.randint(0, 4, (16,))


def test_dataloader_wait_matches_a_known_sleep() -> None:
    delay = 0.030
    assert ta.start() is not None
    n = train(mlp(), DataLoader(SleepyBatches(25, delay), batch_size=None, num_workers=0))
    steps = snapshot_steps(ta.current(), n)
    assert len(steps) == n == 25
    check_records(steps)
    data_ms = [s.phases["data"] / MS for s in steps]
    assert median(data_ms) == pytest.approx(delay * 1000, rel=0.10), data_ms
    assert min(data_ms) >= delay * 1000 * 0.98  # a sleep never ends early
    # the wait is data, not "other": the rest of the step is the tiny MLP's work
    assert median([s.phases["other"] / MS for s in steps]) < delay * 1000 * 0.2


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
    assert median([s.phases["data"] / MS for s in steps[2:]]) < 2.0
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


@pytest.mark.parametrize("auto", [True, False])
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


# -- start / stop --------------------------------------------------------------------------------
def patched_state() -> dict[str, object]:
    """Everything the hooks may touch: whole class and module namespaces, and the hook registries."""
    from torch.nn.modules import module as module_mod
    from torch.optim import optimizer as optim_mod

    owners = {
        "base_iter": dataloader_mod._BaseDataLoaderIter,
        "single_iter": dataloader_mod._SingleProcessDataLoaderIter,
        "multi_iter": dataloader_mod._MultiProcessingDataLoaderIter,
        "queue": queue.Queue,
        "tensor": torch.Tensor,
        "autograd": torch.autograd,
        "grad_scaler": torch.amp.GradScaler,
        "optimizer": torch.optim.Optimizer,
        "module": nn.Module,
    }
    # submodules that a lazy import adds to a namespace are not patches
    state: dict[str, object] = {
        name: {k: id(v) for k, v in vars(owner).items() if not isinstance(v, types.ModuleType)}
        for name, owner in owners.items()
    }
    for name in (
        "_global_forward_pre_hooks",
        "_global_forward_hooks",
        "_global_backward_pre_hooks",
        "_global_backward_hooks",
        "_global_forward_hooks_always_called",
    ):
        state[name] = len(getattr(module_mod, name))
    state["opt_pre"] = len(optim_mod._global_optimizer_pre_hooks)
    state["opt_post"] = len(optim_mod._global_optimizer_post_hooks)
    return state


def module_hooks(model: nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def test_start_stop_start_restores_everything(runtime_dir) -> None:
    before = patched_state()
    assert before["_global_forward_pre_hooks"] == before["opt_pre"] == before["opt_post"] == 0

    model = mlp()
    original_forward = nn.Sequential.forward
    for round_ in range(2):
        agent = ta.start()
        assert agent is not None and ta.current() is agent
        assert ta.start() is agent  # a second start is the same agent
        during = patched_state()
        assert during["base_iter"]["__next__"] != before["base_iter"]["__next__"]
        assert during["autograd"]["backward"] != before["autograd"]["backward"]
        assert during["_global_forward_pre_hooks"] == 1
        # the optimizer is timed inside torch's step wrapper, not by global step hooks
        assert during["opt_pre"] == during["opt_post"] == 0
        assert during["_global_backward_hooks"] == 0  # never global full-backward hooks
        assert [a["pid"] for a in discovery.list_agents()] == [agent.pid]

        n = train(model, tensor_loader(5))
        steps = snapshot_steps(agent, n)
        assert [s.i for s in steps] == list(range(5)), f"round {round_}"
        # the root's class forward is wrapped (no instance hooks: nn.Module keeps its fast path)
        assert module_hooks(model) == 0
        assert nn.Sequential.forward is not original_forward
        assert getattr(inner_step(torch.optim.SGD), "_torchtop_step", False)

        port = agent.port
        ta.stop()
        assert ta.current() is None
        assert patched_state() == before
        assert module_hooks(model) == 0
        assert nn.Sequential.forward is original_forward
        assert not getattr(inner_step(torch.optim.SGD), "_torchtop_step", False)
        assert inner_step(torch.optim.SGD) is torch.optim.SGD.step.__wrapped__  # torch's own step again
        assert list(runtime_dir.glob("agent-*.json")) == []
        # its sockets are closed: the port can be bound again at once
        import zmq

        sock = zmq.Context.instance().socket(zmq.ROUTER)
        try:
            sock.bind(f"tcp://127.0.0.1:{port}")
        finally:
            sock.close(linger=0)

    ta.stop()  # stopping a stopped agent is a no-op
    # training goes on untouched with the agent off
    assert train(model, tensor_loader(3)) == 3


def test_restart_on_the_same_port_at_once() -> None:
    """stop() returns once the ports are free: start/stop can alternate on a fixed port."""
    first = ta.start()
    assert first is not None
    port = first.port
    ta.stop()
    for _ in range(5):
        agent = ta.start(port=port)
        assert agent is not None and agent.port == port
        ta.stop()


def test_discovery_file_describes_the_agent(runtime_dir) -> None:
    agent = ta.start()
    assert agent is not None
    (info,) = discovery.list_agents()
    assert info["pid"] == agent.pid and info["port"] == agent.port and info["pub_port"] == agent.port + 1
    assert info["run_id"] == agent.run_id and info["rank"] == 0
    assert info["file"] == str(runtime_dir / f"agent-{agent.pid}.json")
    assert (runtime_dir / f"agent-{agent.pid}.json").stat().st_mode & 0o777 == 0o600


# -- never in the way ----------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["enter", "exit", "boundary"])
def test_failing_replay_is_counted_and_recovers(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The monitor's replay of the log fails on every entry: each failure is counted (as hook
    errors), training is untouched, and once the replay works again steps come through."""
    agent = ta.start()
    assert agent is not None
    client = client_for(agent)
    try:
        client.hello()
        calls = []
        orig = getattr(StepRecorder, method)

        def boom(*args, **kwargs):
            calls.append(method)
            raise RuntimeError("injected failure")

        monkeypatch.setattr(StepRecorder, method, boom)
        model = mlp()
        w0 = model[0].weight.detach().clone()
        assert train(model, tensor_loader(30)) == 30
        assert not torch.equal(w0, model[0].weight)
        errors, steps = 0, []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not (calls and errors >= len(calls)):
            for batch in client.recv_batches(0.3):
                errors = batch.hook_errors
                steps += batch.steps
        assert calls, "the injected failure was never reached"
        assert errors == client.replay.failures >= len(calls) and steps == []

        monkeypatch.setattr(StepRecorder, method, orig)
        assert train(model, tensor_loader(10)) == 10
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and len(steps) < 8:
            for batch in client.recv_batches(0.3):
                steps += batch.steps
        assert len(steps) >= 8  # the first step after the failures is dropped (its start was lost)
        check_records(steps)
        assert agent.probe.active and agent.probe.failures == 0
    finally:
        client.close()


@pytest.mark.parametrize("method", ["enter", "exit", "open_step", "cut", "forward"])
def test_failing_probe_never_breaks_the_explicit_api(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    agent = ta.start(auto=False)
    assert agent is not None
    probe = agent.probe

    def boom(*args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(Probe, method, boom)
    done = 0
    for _ in range(2 * MAX_FAILURES):
        with ta.step():
            with ta.phase("data"):
                pass
            with ta.phase("forward"):
                done += 1
    assert done == 2 * MAX_FAILURES
    assert probe.failures == MAX_FAILURES and probe.active is False and probe.tid == 0


def test_failing_hot_path_never_breaks_training() -> None:
    """The training thread's own append fails (as under MemoryError): the wrappers swallow it."""
    agent = ta.start()
    assert agent is not None

    def boom(entry):
        raise MemoryError("injected")

    agent.probe.put = boom
    model = mlp()
    assert train(model, tensor_loader(30)) == 30
    assert agent.probe.failures == MAX_FAILURES and agent.probe.active is False


def test_fork_workers_train_with_the_agent_on() -> None:
    """DataLoader workers forked from a process with the agent running: they undo its patches."""
    from torch.nn.modules import module as module_mod

    orig_next = dataloader_mod._BaseDataLoaderIter.__next__

    class Probe(Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int):
            # in the worker: the agent is gone and the DataLoader is the original again
            clean = (
                ta.current() is None
                and dataloader_mod._BaseDataLoaderIter.__next__ is orig_next
                and not module_mod._global_forward_pre_hooks
            )
            return torch.randn(32), torch.tensor(i % 4), torch.tensor(int(clean))

    agent = ta.start()
    assert agent is not None
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(Probe(), batch_size=8, num_workers=2, multiprocessing_context="fork")
    flags = []
    n = 0
    for _epoch in range(2):
        for x, y, clean in loader:
            flags.extend(clean.tolist())
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            n += 1
    assert n == 16
    assert flags == [1] * 128
    steps = snapshot_steps(agent, n)
    assert [s.i for s in steps] == list(range(16))
    check_records(steps)
    assert all(s.phases["data"] > 0 for s in steps)
    # the workers exited without touching the parent's discovery file or sockets
    assert [a["pid"] for a in discovery.list_agents()] == [agent.pid]
    assert client_for(agent).hello().pid == agent.pid


# -- the log and its replay ----------------------------------------------------------------------
def _at(t: int, code: int) -> int:
    return t << SHIFT | code


def test_probe_log_is_bounded_when_nobody_drains_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stalled agent thread: the oldest half goes, its steps are counted as dropped, and the
    replay is told (RESET) so it never stitches two halves of a step together."""
    monkeypatch.setattr(probe_mod, "LOG_CAP", 40)
    probe = Probe()
    for _ in range(30):  # 3 entries a step
        probe.enter(FORWARD)
        probe.exit(FORWARD)
        probe.cut()
    log, cut = probe.drain()
    assert cut == 30
    assert len(log) <= 40 and probe.dropped > 0
    assert log[0] == RESET and log[1] & 0xFF == BOUNDARY  # the kept steps open at a boundary
    rec = StepRecorder()
    steps = rec.feed(log)
    assert len(steps) + probe.dropped == 30  # every step is either replayed whole or counted as dropped
    assert all(s[4][FORWARD] > 0 and s[3] >= s[4][FORWARD] for s in steps)
    assert probe.drain() == ([], 30) and rec.failures == 0


def test_replay_nesting_is_exclusive() -> None:
    """Nested phases pause the outer one, h2d is carved out, a phase open at a boundary is split."""
    t0 = 1000
    log = [
        _at(t0 + 0, DATA),
        _at(t0 + 10, EXIT | DATA),
        _at(t0 + 10, FORWARD_START + 2 * 1 + 1),  # root slot 1, grad on
        (_at(t0 + 12, H2D_COPY), 3, 4096, True, None),
        _at(t0 + 30, EXIT | FORWARD),
        _at(t0 + 30, BACKWARD),
        _at(t0 + 35, BACKWARD),  # nested (a reentrant checkpoint)
        _at(t0 + 40, EXIT | BACKWARD),
        _at(t0 + 50, EXIT | BACKWARD),
        _at(t0 + 52, OPTIMIZER),
        _at(t0 + 55, BOUNDARY),  # the optimizer phase is still open: split at the boundary
        (_at(t0 + 56, MARK), "loss", 0.5),  # right after the boundary: belongs to the step that ended
        _at(t0 + 60, EXIT | OPTIMIZER),
        _at(t0 + 70, BOUNDARY),
    ]
    rec = StepRecorder()
    (i0, kind, s0, wall, acc, micro, events, extra), (i1, _, s1, wall1, acc1, micro1, _, _) = rec.feed(log)
    assert (i0, kind, s0, wall, micro, events) == (0, "train", 1000, 55, 1, None)
    assert acc[DATA] == 10 and acc[FORWARD] == 17 and acc[H2D] == 3 and acc[BACKWARD] == 20 and acc[OPTIMIZER] == 3
    assert sum(acc) == 53  # 2 ns between backward and optimizer are "other"
    assert extra == {"pinned": 4096, "marks": {"loss": 0.5}}
    assert (i1, s1, wall1, micro1) == (1, 1055, 15, 0)
    assert acc1[OPTIMIZER] == 5 and sum(acc1) == 5
    assert rec.failures == 0


def test_replay_cuts_evaluation_iterations() -> None:
    """No-grad forwards with no backward or optimizer: eval steps, cut at the next fetch or the
    next forward of the same root."""
    log = []
    t = 1000
    for _ in range(3):  # with a DataLoader
        log += [_at(t, DATA), _at(t + 5, EXIT | DATA), _at(t + 5, FORWARD_START + 2 * 1), _at(t + 20, EXIT | FORWARD)]
        t += 30
    for _ in range(3):  # forwards only, no loader
        log += [_at(t, FORWARD_START + 2 * 1), _at(t + 20, EXIT | FORWARD)]
        t += 30
    log += [_at(t, FORWARD_START + 2 * 1 + 1), _at(t + 10, EXIT | FORWARD), _at(t + 10, BACKWARD),
            _at(t + 20, EXIT | BACKWARD), _at(t + 20, OPTIMIZER), _at(t + 25, EXIT | OPTIMIZER), _at(t + 25, BOUNDARY)]
    steps = StepRecorder().feed(log)
    assert [s[1] for s in steps] == ["eval"] * 5 + ["train"]
    assert [s[4][DATA] for s in steps[:2]] == [5, 5] and all(s[4][FORWARD] == 15 for s in steps[:2])
    assert steps[-1][4][BACKWARD] == 10 and steps[-1][5] == 1


def test_replay_survives_garbage_entries() -> None:
    """An entry the replay cannot use is counted and forgets the open step (whose start is then
    unknown: not reported); the steps after the next boundary are whole and reported."""
    rec = StepRecorder()
    log = [_at(100, FORWARD_START + 3), (_at(110, H2D_COPY), "not", "numbers"), _at(120, EXIT | FORWARD),
           _at(130, FORWARD_START + 3), _at(140, EXIT | FORWARD), _at(150, BOUNDARY),
           _at(160, FORWARD_START + 3), _at(170, EXIT | FORWARD), _at(180, BOUNDARY), _at(185, 30), _at(190, BOUNDARY)]
    steps = rec.feed(log)
    assert rec.failures == 2  # the bad tuple, and an int with an unknown code
    assert len(steps) == 1 and steps[0][2] == 150 and steps[0][3] == 30 and steps[0][4][FORWARD] == 10


