"""Issue 25: a loop with no optimizer.step() (weights updated by hand, as word_language_model
does; an optimizer torchtop does not hook) is not invisible: after a few backward passes with
no optimizer step, each backward's end ends a step (agent/hooks/probe.py `backward_ended`)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import torchtop.agent as ta
from tests.agent_util import snapshot_steps
from tests.test_optimizer_steps import model_and_batches, train
from torchtop.agent.hooks.probe import NO_OPT_BACKWARDS


def manual_sgd(model: nn.Module, data: list, lr: float = 0.01) -> None:
    for x, y in data:
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            if p.grad is not None:  # every parameter has one after backward
                p.data.add_(p.grad, alpha=-lr)


def test_a_loop_that_updates_weights_by_hand_shows_its_steps() -> None:
    model, data = model_and_batches(30)
    assert ta.start() is not None
    try:
        manual_sgd(model, data)
        # the first NO_OPT_BACKWARDS backwards open the count: one step each from there
        n = len(data) - NO_OPT_BACKWARDS
        steps = snapshot_steps(ta.current(), n)
        assert len(steps) == n, len(steps)
        assert all(s.at_backward and s.micro == 1 for s in steps), steps[:3]
        assert all(s.phases["forward"] > 0 and s.phases["backward"] > 0 for s in steps)
    finally:
        ta.stop()


def test_an_optimizer_step_takes_the_boundary_back() -> None:
    """Gradient accumulation of 8: its first backwards are cut one by one until the optimizer
    steps; from then on a step is the optimizer's (8 micro-batches), said by no record."""
    model, data = model_and_batches(48)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    assert ta.start() is not None
    try:
        for k, (x, y) in enumerate(data, 1):
            nn.functional.cross_entropy(model(x), y).backward()
            if k % 8 == 0:
                opt.step()
                opt.zero_grad()
        steps = snapshot_steps(ta.current(), 1)
        last = [s for s in steps if not s.at_backward]
        assert len(last) >= 4 and all(s.micro == 8 and s.phases["optimizer"] > 0 for s in last[-4:]), last
    finally:
        ta.stop()


def test_a_reentrant_checkpoint_backward_inside_the_backward_cuts_nothing() -> None:
    """torch.utils.checkpoint(use_reentrant=True) calls torch.autograd.backward inside the
    backward: only the outermost backward ends a step."""
    model, data = model_and_batches(20)

    class Ckpt(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.inner, x.requires_grad_(), use_reentrant=True)

    root = Ckpt()
    assert ta.start() is not None
    try:
        manual_sgd(root, data)
        steps = snapshot_steps(ta.current(), len(data) - NO_OPT_BACKWARDS)
        assert len(steps) == len(data) - NO_OPT_BACKWARDS, len(steps)
    finally:
        ta.stop()


def test_a_loop_with_an_optimizer_is_unchanged() -> None:
    model, data = model_and_batches(12)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    assert ta.start() is not None
    try:
        train(model, opt, data)
        steps = snapshot_steps(ta.current(), len(data))
        assert len(steps) == len(data) and not any(s.at_backward for s in steps)
    finally:
        ta.stop()
