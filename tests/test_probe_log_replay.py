"""The probe's log and the monitor's replay of it, fed by hand: no training loop, no sockets.

The log is bounded when nobody drains it, nested phases are exclusive, evaluation iterations are
cut without an optimizer, and entries the replay cannot use are counted and never stitch steps.
"""

from __future__ import annotations

import pytest

from torchtop.agent.hooks import probe as probe_mod
from torchtop.agent.hooks.probe import Probe
from torchtop.contract.logcodes import (
    BOUNDARY,
    EXIT,
    FORWARD_START,
    H2D_COPY,
    MARK,
    RESET,
    SHIFT,
    STEP_END,
    STEP_EVENT,
)
from torchtop.monitor.model.replay import BACKWARD, DATA, FORWARD, H2D, OPTIMIZER, StepRecorder


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
    first = log[1]
    assert log[0] == RESET and isinstance(first, int) and first & 0xFF == BOUNDARY  # open at a boundary
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
    assert (
        acc[DATA] == 10
        and acc[FORWARD] == 17
        and acc[H2D] == 3
        and acc[BACKWARD] == 20
        and acc[OPTIMIZER] == 3
    )
    assert sum(acc) == 53  # 2 ns between backward and optimizer are "other"
    assert extra == {"pinned": 4096, "marks": {"loss": 0.5}}
    assert (i1, s1, wall1, micro1) == (1, 1055, 15, 0)
    assert acc1[OPTIMIZER] == 5 and sum(acc1) == 5
    assert rec.failures == 0


def test_a_closures_code_inside_the_optimizer_step_is_other() -> None:
    """optimizer.step(closure) runs the forward and backward inside the step (Lightning's
    automatic optimization, LBFGS): the closure's code around them (the loss, logging) is other,
    the optimizer keeps what runs after the last backward, on the host and on the GPU."""
    t0 = 1000
    log = [
        _at(t0, BOUNDARY),
        (_at(t0, STEP_EVENT), 0.0),
        (_at(t0 + 0, OPTIMIZER), 0.0),
        (_at(t0 + 5, FORWARD_START + 2 * 1 + 1), 0.5),  # 5 ns of the closure before its forward
        (_at(t0 + 20, EXIT | FORWARD), 2.0),
        (_at(t0 + 30, BACKWARD), 3.0),  # 10 ns of the loss and its logging
        (_at(t0 + 50, EXIT | BACKWARD), 6.0),
        (_at(t0 + 58, STEP_END), 7.0),  # the optimizer's own 8 ns
        (_at(t0 + 60, OPTIMIZER), 7.0),  # the next step's: no closure, all optimizer
        (_at(t0 + 64, STEP_END), 8.0),
    ]
    rec = StepRecorder()
    (_, _, _, wall, acc, micro, device, _), (_, _, _, wall1, acc1, _, _, _) = rec.feed(log)
    assert wall == 58 and micro == 1
    assert (acc[FORWARD], acc[BACKWARD], acc[OPTIMIZER]) == (15, 20, 8)
    assert wall - sum(acc) == 15  # other: the closure's own code
    assert device == {"step": 7.0, "forward": 1.5, "backward": 3.0, "optimizer": 1.0}
    assert (wall1, acc1[OPTIMIZER]) == (6, 4)  # a step without a closure is unchanged
    assert rec.failures == 0


def test_replay_cuts_evaluation_iterations() -> None:
    """No-grad forwards with no backward or optimizer: eval steps, cut at the next fetch or the
    next forward of the same root."""
    log = []
    t = 1000
    for _ in range(3):  # with a DataLoader
        log += [
            _at(t, DATA),
            _at(t + 5, EXIT | DATA),
            _at(t + 5, FORWARD_START + 2 * 1),
            _at(t + 20, EXIT | FORWARD),
        ]
        t += 30
    for _ in range(3):  # forwards only, no loader
        log += [_at(t, FORWARD_START + 2 * 1), _at(t + 20, EXIT | FORWARD)]
        t += 30
    log += [
        _at(t, FORWARD_START + 2 * 1 + 1),
        _at(t + 10, EXIT | FORWARD),
        _at(t + 10, BACKWARD),
        _at(t + 20, EXIT | BACKWARD),
        _at(t + 20, OPTIMIZER),
        _at(t + 25, EXIT | OPTIMIZER),
        _at(t + 25, BOUNDARY),
    ]
    steps = StepRecorder().feed(log)
    assert [s[1] for s in steps] == ["eval"] * 5 + ["train"]
    assert [s[4][DATA] for s in steps[:2]] == [5, 5] and all(s[4][FORWARD] == 15 for s in steps[:2])
    assert steps[-1][4][BACKWARD] == 10 and steps[-1][5] == 1


def test_replay_survives_garbage_entries() -> None:
    """An entry the replay cannot use is counted and forgets the open step (whose start is then
    unknown: not reported); the steps after the next boundary are whole and reported."""
    rec = StepRecorder()
    log = [
        _at(100, FORWARD_START + 3),
        (_at(110, H2D_COPY), "not", "numbers"),
        _at(120, EXIT | FORWARD),
        _at(130, FORWARD_START + 3),
        _at(140, EXIT | FORWARD),
        _at(150, BOUNDARY),
        _at(160, FORWARD_START + 3),
        _at(170, EXIT | FORWARD),
        _at(180, BOUNDARY),
        _at(185, 17),
        _at(190, BOUNDARY),
    ]
    steps = rec.feed(log)
    assert rec.failures == 2  # the bad tuple, and an int with an unknown code
    assert len(steps) == 1 and steps[0][2] == 150 and steps[0][3] == 30 and steps[0][4][FORWARD] == 10
