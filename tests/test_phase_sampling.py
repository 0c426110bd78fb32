"""Phase sampling as users run it: ~20 steps a second logged whole, the rest by their boundary
alone with the phase wrappers out of the call path; evaluation loops always logged."""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from torch.utils.data import dataloader as dataloader_mod  # noqa: E402

import torchtop.agent as ta  # noqa: E402
from tests.agent_util import snapshot_steps  # noqa: E402
from torchtop.monitor.report import build_report  # noqa: E402
from torchtop.monitor.state import RunState  # noqa: E402


@pytest.fixture(autouse=True)
def _default_sampling(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHTOP_PHASE_PERIOD_MS", raising=False)


def test_phases_are_sampled_and_the_wrappers_leave_dark_steps() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(4096, 16), torch.randint(0, 4, (4096,)))
    orig_next, orig_backward = dataloader_mod._BaseDataLoaderIter.__next__, torch.autograd.backward
    agent = ta.start()
    assert agent is not None
    seen = {"lit": 0, "dark": 0}
    n = 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.5:
        for x, y in DataLoader(data, batch_size=16):
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            n += 1
            # after the boundary: the next step is lit (wrappers in) or dark (the originals back)
            if agent.probe.tid:
                seen["lit"] += 1
                assert dataloader_mod._BaseDataLoaderIter.__next__ is not orig_next
                assert torch.autograd.backward is not orig_backward
            else:
                seen["dark"] += 1
                assert dataloader_mod._BaseDataLoaderIter.__next__ is orig_next
                assert torch.autograd.backward is orig_backward
            if time.monotonic() - t0 >= 1.5:
                break
    elapsed = time.monotonic() - t0
    assert seen["lit"] >= 5 and seen["dark"] > seen["lit"], seen

    # an evaluation loop on a dark step: its no-grad forward lights the log, every iteration counts
    model.eval()
    with torch.no_grad():
        for k, (x, _) in enumerate(DataLoader(data, batch_size=16)):
            model(x)
            if k == 9:
                break
    model.train()
    x, y = data[:16]
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()

    steps = snapshot_steps(agent, n + 10, kind=None)  # the training steps, the evaluation ones, the last
    train = [s for s in steps if s.kind == "train"]
    lit = [s for s in train if s.phases]
    assert len(train) >= n - 1
    assert 5 <= len(lit) <= elapsed / 0.05 + 3, (len(lit), elapsed)  # at most one per 50 ms
    assert all(s.wall_ns > 0 for s in train)
    assert all(sum(s.phases.values()) == s.wall_ns and s.phases["forward"] > 0 for s in lit)
    evals = [s for s in steps if s.kind == "eval"]
    assert len(evals) >= 9 and all(s.phases and s.phases["data"] > 0 for s in evals[1:]), evals[:3]

    state = RunState()
    state.steps.extend(steps)
    report = build_report(state, 60.0, window=float("inf"))
    assert report["sampled_steps"] == len(lit)  # training steps; evaluation is reported apart
    assert sum(report["breakdown"].values()) == pytest.approx(1.0)
    assert report["steps"] == len(train)
    ta.stop()
    assert dataloader_mod._BaseDataLoaderIter.__next__ is orig_next and torch.autograd.backward is orig_backward
