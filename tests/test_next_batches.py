"""Issue 39 item 5: batches pulled by hand, `x, y = next(src)`, a few micro-batches a step. From a
DataLoader's iterator (its `__next__` is hooked) and from `torchtop.agent.data(gen)` each pull
is the data phase; from a plain generator the stack sampler marks it as the loop's input
(test_why_functions.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import torchtop.agent as ta
from tests.agent_util import snapshot_steps

MS = 1_000_000
ACCUMULATE = 4
SLEEP_MS = 3.0


class Sleepy(Dataset):
    """Each item costs SLEEP_MS of sleep: a stand-in for a slow read."""

    def __len__(self) -> int:
        return 1_000

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(SLEEP_MS / 1e3)
        return torch.randn(16), torch.tensor(i % 4)


def sleepy_gen() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    while True:
        time.sleep(SLEEP_MS / 1e3)
        yield torch.randn(1, 16), torch.randint(0, 4, (1,))


def pulled(src: object, steps: int) -> list[int]:
    """A grad-accumulation loop that takes ACCUMULATE micro-batches a step with next(src); the
    ns each step spent inside next(), timed here."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    waits: list[int] = []
    for _ in range(steps):
        waited = 0
        for _ in range(ACCUMULATE):
            t = time.perf_counter_ns()
            x, y = next(src)  # type: ignore[call-overload]
            waited += time.perf_counter_ns() - t
            nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        waits.append(waited)
    return waits


def check(waits: list[int]) -> None:
    steps = snapshot_steps(ta.current(), len(waits) - 1)
    assert len(steps) >= len(waits) - 1
    # nested intervals, whatever the machine's speed: the sleeps lie inside the data phase,
    # which lies inside this loop's own next() calls (the first step's start is the first forward)
    for s, outer in zip(steps[1:], waits[len(waits) - len(steps) + 1 :]):
        assert ACCUMULATE * SLEEP_MS * MS <= s.phases["data"] <= outer, (s.phases["data"] / MS, outer / MS)


@pytest.mark.slow  # a DataLoader's start: over the fast subset's budget; it passed before issue 39 too
def test_next_on_a_dataloaders_iterator_is_data() -> None:
    assert ta.start() is not None
    check(pulled(iter(DataLoader(Sleepy(), batch_size=1)), 6))


def test_next_on_a_wrapped_generator_is_data() -> None:
    assert ta.start() is not None
    check(pulled(ta.data(sleepy_gen()), 6))
