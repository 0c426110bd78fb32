"""A pipeline stage's own work inside its schedule, in process on CPU (a one-rank gloo group).

torch.distributed.pipelining runs each micro-batch through the stage in `forward_one_chunk` and
`backward_one_chunk`, and the last stage's loss in the schedule's `_compute_loss`; the other hooks
time only the stage module's forward and `autograd.backward` inside them, so the loss and the
chunks' own work read as `other` (issue 29: the last stage, which alone computes the loss, looked
slower in nothing but `other`). agent/hooks/pipeline.py times them as forward and backward.
Here the loss and a custom weight-gradient function (`dw_builder`, run by the backward chunk
outside `autograd.backward`) each sleep: that time is forward and backward, not other.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.agent_util import snapshot_steps

torch = pytest.importorskip("torch")
dist = torch.distributed

MICRO = 4
LOSS_S = 0.003  # each micro-batch's loss sleeps this long
DW_S = 0.002  # and its weight-gradient function this long


def _schedule() -> tuple[Any, Any]:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    mb = torch.empty(4, 16)

    def dw_builder() -> Any:
        return lambda: time.sleep(DW_S)

    stage = PipelineStage(
        block, 0, 1, torch.device("cpu"), input_args=mb, output_args=mb, output_grads=mb,
        input_grads=mb, dw_builder=dw_builder,
    )  # fmt: skip

    def loss_fn(out: Any, y: Any) -> Any:
        time.sleep(LOSS_S)
        return (out - y).pow(2).mean()

    sched = ScheduleGPipe(stage, n_microbatches=MICRO, loss_fn=loss_fn)
    return sched, torch.optim.SGD(block.parameters(), lr=1e-3)


def test_a_stages_chunks_and_its_loss_are_forward_and_backward(agent, group) -> None:
    sched, opt = _schedule()
    agent.hooks.waits.tick()  # what the agent thread does once pipelining is imported
    x = torch.randn(4 * MICRO, 16)
    for _ in range(16):
        sched.step(x, target=x)
        opt.step()
        opt.zero_grad()
    steps = [s for s in snapshot_steps(agent, 16) if s.phases]
    assert len(steps) >= 3
    for s in steps[1:]:
        ph = s.phases
        assert ph["forward"] >= MICRO * LOSS_S * 1e9, ph  # the loss is the last stage's forward
        assert ph["backward"] >= MICRO * DW_S * 1e9, ph  # the backward chunk's own work
        # an autograd.backward nested in a backward chunk is not a second micro-batch
        assert s.micro == MICRO, s.micro
    # what is left is the schedule's loop: less than the sleeps it no longer holds (a ratio of
    # medians, not a bound in ms: a loaded machine stretches the loop's Python, not the sleeps)
    med = {k: sorted(s.phases[k] for s in steps[1:])[len(steps[1:]) // 2] for k in ("forward", "other")}
    assert med["other"] < med["forward"], med


def test_the_chunks_are_ours_once_and_restored(agent, group) -> None:
    from torch.distributed.pipelining import schedules, stage

    agent.hooks.waits.tick()  # pipelining is imported (by now, or by an earlier test)
    ours = stage._PipelineStageBase.__dict__["forward_one_chunk"]
    for cls, name in [
        (stage._PipelineStageBase, "forward_one_chunk"),
        (stage._PipelineStageBase, "backward_one_chunk"),
        (stage._PipelineStageBase, "backward_weight_one_chunk"),
        (stage._PipelineStageBase, "perform_reduce_grad"),
        (schedules._PipelineSchedule, "_compute_loss"),
    ]:
        assert cls.__dict__[name].__code__.co_filename.startswith("<torchtop"), name
    # the schedule's send/recv, posted and waited for: the pipeline's comm (waits.py)
    for name in ("_batch_p2p", "_wait_batch_p2p"):
        assert getattr(schedules, name).__code__.co_filename.startswith("<torchtop"), name
    agent.hooks.waits.tick()  # a second tick wraps nothing twice
    assert stage._PipelineStageBase.__dict__["forward_one_chunk"] is ours
    agent.hooks.uninstall()
    assert stage._PipelineStageBase.__dict__["forward_one_chunk"] is ours.__wrapped__
    assert not ours.__wrapped__.__code__.co_filename.startswith("<torchtop")
