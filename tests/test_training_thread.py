"""Training on a thread other than the one that called start() (issue 26, item 9): the thread that
trains is the first to run a backward or an optimizer step before any step was cut, and every
step of it is counted. Once steps are cut, another thread's backward does not take it over."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")

import torchtop.agent as ta  # noqa: E402
from tests.agent_util import check_records, mlp, snapshot_steps, tensor_loader, train  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_warm_torch")


def _on_thread(fn, *args) -> list[int]:  # type: ignore[no-untyped-def]
    out: list[int] = []
    t = threading.Thread(target=lambda: out.append(fn(*args)))
    t.start()
    t.join(60)
    return out


def test_a_loop_on_a_thread_of_its_own_is_counted() -> None:
    agent = ta.start()
    assert agent is not None
    model = mlp()
    (n,) = _on_thread(train, model, tensor_loader(25))
    steps = snapshot_steps(agent, n)
    assert n == 25
    assert [s.i for s in steps] == list(range(25))
    check_records(steps)
    assert all(s.phases["forward"] > 0 and s.phases["backward"] > 0 for s in steps[1:])
    assert agent.probe.tid not in (0, threading.get_ident())


def test_another_thread_does_not_take_over_once_steps_are_cut() -> None:
    agent = ta.start()
    assert agent is not None
    model = mlp()
    n = train(model, tensor_loader(10))  # the main thread trains: its steps are cut
    tid = agent.probe.tid

    def stray() -> int:  # a thread's backward and step after that: not the training thread
        other = mlp()
        opt = torch.optim.SGD(other.parameters(), lr=0.1)
        other(torch.randn(4, 32)).sum().backward()
        opt.step()
        return 0

    _on_thread(stray)
    n += train(model, tensor_loader(10))
    steps = snapshot_steps(agent, n)
    assert agent.probe.tid == tid == threading.get_ident()
    assert len(steps) == n == 20


@pytest.mark.slow
def test_torchtop_1_counts_a_loop_on_a_thread(subprocess_env: dict[str, str]) -> None:
    """TORCHTOP=1 (the agent started at interpreter start-up, on the main thread), training on
    another thread: every step counted."""
    import subprocess
    import sys

    code = (
        "import threading, torch\n"
        "def train():\n"
        "    model = torch.nn.Linear(8, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "    for _ in range(20):\n"
        "        opt.zero_grad(); model(torch.randn(4, 8)).sum().backward(); opt.step()\n"
        "t = threading.Thread(target=train); t.start(); t.join()\n"
        "import torchtop.agent as ta\n"
        "print('steps', ta.current().probe.steps)\n"
    )
    env = dict(subprocess_env, TORCHTOP="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["steps", "20"], out.stdout
