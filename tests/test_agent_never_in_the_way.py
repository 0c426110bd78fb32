"""The agent never gets in the way of a real CPU training loop: start/stop leaves nothing behind,
and a failure inside the agent never reaches training.

Each test starts the in-process agent and trains; start/stop checks every patched namespace and
hook registry against its state before, the failure tests inject errors into the probe, the replay
and the training thread's own append (the conftest fixture stops the agent afterwards).
"""

from __future__ import annotations

import queue
import time
import types
from pathlib import Path
from typing import Any, cast

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402
from torch.utils.data import dataloader as dataloader_mod  # noqa: E402

import torchtop.agent as ta  # noqa: E402
from tests.agent_util import check_records, client_for, inner_step, mlp, snapshot_steps, tensor_loader, train  # noqa: E402
from torchtop.agent.hooks.probe import MAX_FAILURES, Probe  # noqa: E402
from torchtop.contract import discovery  # noqa: E402
from torchtop.monitor.model.replay import StepRecorder  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_warm_torch")


# -- start / stop --------------------------------------------------------------------------------
def patched_state() -> dict[str, Any]:
    """Everything the hooks may touch: whole class and module namespaces, and the hook registries."""
    import torch.optim.optimizer as optim_mod  # torch.optim dels the name `optimizer`
    from torch.nn.modules import module as module_mod

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
    state: dict[str, Any] = {
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
        assert [a.pid for a in discovery.list_agents()] == [agent.pid]

        n = train(model, tensor_loader(5))
        steps = snapshot_steps(agent, n)
        assert [s.i for s in steps] == list(range(5)), f"round {round_}"
        # the root's class forward is wrapped (no instance hooks: nn.Module keeps its fast path)
        assert module_hooks(model) == 0
        assert nn.Sequential.forward is not original_forward
        assert getattr(inner_step(torch.optim.SGD), "_torchtop_step", False)

        address = agent.sockets.address
        ta.stop()
        assert ta.current() is None
        assert patched_state() == before
        assert module_hooks(model) == 0
        assert nn.Sequential.forward is original_forward
        assert not getattr(inner_step(torch.optim.SGD), "_torchtop_step", False)
        assert inner_step(torch.optim.SGD) is torch.optim.SGD.step.__wrapped__  # torch's own step again
        assert list(runtime_dir.glob("agent-*.json")) == []
        # its sockets are closed and their files gone: the address can be bound again at once
        import zmq

        assert not Path(address.removeprefix("ipc://")).exists()
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        try:
            sock.bind(address)
        finally:
            sock.close(linger=0)

    ta.stop()  # stopping a stopped agent is a no-op
    # training goes on untouched with the agent off
    assert train(model, tensor_loader(3)) == 3


def test_restart_on_the_same_port_at_once() -> None:
    """stop() returns once the ports are free: start/stop can alternate on a fixed port."""
    first = ta.start(port=0)  # TCP on a free pair
    assert first is not None and first.port
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
    assert info.pid == agent.pid and info.transport == "ipc" and info.port is None
    assert info.address == f"ipc://{runtime_dir}/agent-{agent.pid}.req"
    assert info.pub_address == f"ipc://{runtime_dir}/agent-{agent.pid}.pub"
    assert info.run_id == agent.run_id and info.rank == 0
    assert info.file == str(runtime_dir / f"agent-{agent.pid}.json")
    assert (runtime_dir / f"agent-{agent.pid}.json").stat().st_mode & 0o777 == 0o600


# -- never in the way ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "method",
    # exit and boundary: among the fast subset's slowest (issue 27: the subset under 60 s)
    ["enter", pytest.param("exit", marks=pytest.mark.slow), pytest.param("boundary", marks=pytest.mark.slow)],
)
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
        first = model[0]
        assert isinstance(first, nn.Linear)
        w0 = first.weight.detach().clone()
        assert train(model, tensor_loader(30)) == 30
        assert not torch.equal(w0, first.weight)
        errors, steps = 0, []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not (calls and errors >= len(calls)):
            for got in client.recv_batches(0.3):
                errors = got.batch.hook_errors + got.log_errors
                steps += got.steps
        assert calls, "the injected failure was never reached"
        assert errors == client.replay.failures >= len(calls) and steps == []

        monkeypatch.setattr(StepRecorder, method, orig)
        assert train(model, tensor_loader(10)) == 10
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and len(steps) < 8:
            for got in client.recv_batches(0.3):
                steps += got.steps
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


@pytest.mark.slow  # among the fast subset's slowest, ~0.9 s here (issue 27: the subset under 60 s)
def test_fork_workers_train_with_the_agent_on() -> None:
    """DataLoader workers forked from a process with the agent running: they undo its patches."""
    from torch.nn.modules import module as module_mod

    orig_next = dataloader_mod._BaseDataLoaderIter.__next__

    class WorkerCheck(Dataset):
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
    loader = DataLoader(WorkerCheck(), batch_size=8, num_workers=2, multiprocessing_context="fork")
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
    assert [a.pid for a in discovery.list_agents()] == [agent.pid]
    assert client_for(agent).hello().pid == agent.pid


def test_ignore_warning_removes_its_own_filter_and_no_other() -> None:
    """The agent quiets torch's warnings about its own doings with one filter entry, and takes
    back exactly that entry: a filter the user added meanwhile stays."""
    import warnings

    from torchtop.agent.warn import ignore_warning

    before = list(warnings.filters)
    try:
        remove = ignore_warning(message=r"torchtop test: ours")
        warnings.filterwarnings("error", message=r"torchtop test: the user's")  # added meanwhile
        users = warnings.filters[0]
        with warnings.catch_warnings(record=True) as seen:  # this test's own thread: safe here
            warnings.warn("torchtop test: ours, quiet", UserWarning, stacklevel=1)
        assert seen == []
        remove()
        remove()  # twice: nothing more goes
        assert warnings.filters == [users, *before]
    finally:
        cast("list[Any]", warnings.filters)[:] = before  # a list; typeshed says Sequence


def test_notices_are_quiet_when_asked_and_problems_are_not(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """What the agent is about to do (where it listens, a FLOP count, a sync window) respects
    TORCHTOP_QUIET; a problem is always said."""
    from torchtop.agent.warn import notice, warn

    monkeypatch.setenv("TORCHTOP_QUIET", "1")
    notice("counting the model's FLOPs")
    warn("cannot write the discovery file")
    assert capsys.readouterr().err.splitlines() == ["torchtop: cannot write the discovery file"]
    monkeypatch.delenv("TORCHTOP_QUIET")
    monkeypatch.setenv("TORCHTOP_VERBOSE", "1")  # notices are said when asked for (test_quiet_start.py)
    notice("counting the model's FLOPs")
    assert capsys.readouterr().err.splitlines() == ["torchtop: counting the model's FLOPs"]
