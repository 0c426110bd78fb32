"""Optimizer steps, timed inside torch's own step wrapper (agent/hooks_optimizer.py): the ways
an optimizer's step is reached that a wrapper on the class alone would miss or count twice."""

from __future__ import annotations

import time

import torch
import torch.optim.optimizer as optim_mod  # torch.optim dels the name `optimizer`
from torch import nn

import torchtop.agent as ta
from tests.agent_util import inner_step, snapshot_steps
from torchtop.agent.hooks import optimizer as hooks_optimizer


def model_and_batches(n: int) -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    g = torch.Generator().manual_seed(1)
    return model, [
        (torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)
    ]


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    data: list,
    sched: torch.optim.lr_scheduler.LRScheduler | None = None,
) -> None:
    for x, y in data:
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()


def check_one_step_per_iteration(n: int) -> None:
    steps = snapshot_steps(ta.current(), n)
    assert len(steps) == n
    assert all(s.phases["optimizer"] > 0 for s in steps)
    assert all(s.micro == 1 for s in steps[1:])


def test_scheduler_created_before_start_still_ends_steps() -> None:
    """An LR scheduler replaces `opt.step` on the instance with a function that holds torch's
    step wrapper, taken before start(): the steps still end at every optimizer step."""
    model, data = model_and_batches(8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    assert "step" in opt.__dict__  # the scheduler's wrapper, holding the class's step of now
    assert ta.start() is not None
    try:
        train(model, opt, data, sched)
        check_one_step_per_iteration(len(data))
    finally:
        ta.stop()


class ClippedSGD(torch.optim.SGD):
    """Clips, then steps as SGD: its step and SGD's are both wrapped by torch."""

    def step(self, closure=None):  # type: ignore[override]
        for group in self.param_groups:
            torch.nn.utils.clip_grad_norm_(group["params"], 1.0)
        return super().step(closure)


def test_optimizer_class_first_built_after_start_is_timed() -> None:
    """torch wraps a class's step at its first instance: one built after start() is timed too
    (through `Optimizer._patch_step_function`)."""
    assert ta.start() is not None
    try:

        class PlainSGD(torch.optim.Optimizer):
            def __init__(self, params, lr: float) -> None:
                super().__init__(params, {"lr": lr})

            @torch.no_grad()
            def step(self, closure=None):  # type: ignore[override]
                for group in self.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            p.add_(p.grad, alpha=-group["lr"])

        model, data = model_and_batches(8)
        opt = PlainSGD(model.parameters(), lr=0.01)
        assert getattr(inner_step(PlainSGD), "_torchtop_step", False)
        train(model, opt, data)
        check_one_step_per_iteration(len(data))
    finally:
        ta.stop()
    assert inner_step(PlainSGD) is PlainSGD.step.__wrapped__  # stop() gives torch its step back


def test_super_step_into_another_wrapped_step_is_one_step() -> None:
    """A subclass's `super().step()` into a step torch also wrapped is not a second step."""
    torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)  # SGD's own step is wrapped by torch
    ClippedSGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    assert ta.start() is not None
    try:
        model, data = model_and_batches(8)
        opt = ClippedSGD(model.parameters(), lr=0.01)
        assert getattr(inner_step(ClippedSGD), "_torchtop_step", False)
        assert getattr(inner_step(torch.optim.SGD), "_torchtop_step", False)
        train(model, opt, data)
        check_one_step_per_iteration(len(data))
    finally:
        ta.stop()


def test_user_step_hooks_still_run_around_the_timed_step() -> None:
    model, data = model_and_batches(6)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    calls: list[str] = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    assert ta.start() is not None
    try:
        train(model, opt, data)
        check_one_step_per_iteration(len(data))
    finally:
        ta.stop()
    assert calls == ["pre", "post"] * len(data)


def test_global_step_hooks_where_torch_wrapper_holds_no_cell(monkeypatch) -> None:
    """Another torch whose step wrapper keeps the real step elsewhere: the global step hooks
    do the same work."""
    monkeypatch.setattr(hooks_optimizer, "_step_cell", lambda fn: None)
    model, data = model_and_batches(8)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    assert ta.start() is not None
    try:
        assert len(optim_mod._global_optimizer_pre_hooks) == len(optim_mod._global_optimizer_post_hooks) == 1
        train(model, opt, data)
        check_one_step_per_iteration(len(data))
    finally:
        ta.stop()
    assert len(optim_mod._global_optimizer_pre_hooks) == len(optim_mod._global_optimizer_post_hooks) == 0


def test_a_closures_forward_backward_and_own_code_are_not_the_optimizers() -> None:
    """`opt.step(closure)` (Lightning's automatic optimization): the forward and backward inside
    the step are theirs, and the closure's own code (here 5 ms of "logging" between them) is
    other, not optimizer: one step per call."""
    model, data = model_and_batches(8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    assert ta.start() is not None
    try:
        for x, y in data:

            def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                time.sleep(0.005)  # the closure's own code: the loss's logging
                loss.backward()
                return loss

            opt.step(closure)
        steps = snapshot_steps(ta.current(), len(data))
    finally:
        ta.stop()
    assert len(steps) == len(data)
    assert all(s.micro == 1 for s in steps)
    assert all(s.phases["forward"] > 0 and s.phases["backward"] > 0 for s in steps)
    # the sleep is other; SGD's own update of four small tensors is a small part of it
    assert all(s.phases["other"] >= 5e6 for s in steps), [s.phases for s in steps]
    assert sum(s.phases["optimizer"] for s in steps) < sum(s.phases["other"] for s in steps) / 2
