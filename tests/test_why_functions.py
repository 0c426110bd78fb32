"""Issue 25 item 8: a stack sample names the user's function (past its comprehensions) and
where it was called from, and marks the loop resuming its input generator from its `for`
(agent/telemetry/stacks.py); the fold sums a function's lines, and moves the generator's
samples from `other` to `data` (monitor/model/hotspots.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.test_why_agent import Blocked, line_of
from torchtop.agent.hooks.frames import classifier_for
from torchtop.agent.telemetry.stacks import OTHER, StackSampler
from torchtop.contract.why import StackSample, function_of
from torchtop.monitor.model.hotspots import fold, with_input_wait
from torchtop.monitor.model.steps import StepRecord

torch = pytest.importorskip("torch")


def test_function_of_strips_comprehensions_and_lambdas() -> None:
    assert function_of("f.<locals>.<genexpr>") == "f"
    assert function_of("C.m.<locals>.<lambda>.<locals>.<listcomp>") == "C.m"
    assert function_of("main.<locals>.compute_metrics") == "main.<locals>.compute_metrics"
    assert function_of("<module>") == "<module>"


def metrics(b: Blocked) -> int:
    return sum(1 for _ in wait_in(b))


def wait_in(b: Blocked) -> Iterator[int]:
    b.ready.set()
    b.release.wait(10)
    yield 1


def loop_with_metrics(b: Blocked) -> None:
    metrics(b)  # the call site


def test_a_sample_names_the_function_and_its_caller() -> None:
    with Blocked(loop_with_metrics) as b:
        s = StackSampler(b.probe, classifier_for(torch)).sample()
    assert s is not None and s.phase == OTHER and not s.input
    assert s.site.endswith(f":{line_of(wait_in, 'b.release.wait')} wait_in"), s.site
    # called from metrics' comprehension: metrics, at that line (the monitor names it by function)
    path, _, qual = s.caller.rpartition(" ")
    assert path.endswith(f":{line_of(metrics, 'return sum')}") and function_of(qual) == "metrics", s.caller


def batches(b: Blocked) -> Iterator[int]:
    while True:
        b.ready.set()
        b.release.wait(10)  # the generator's work
        yield 1


def fed_loop(b: Blocked) -> None:
    assert b.probe is not None
    b.probe.callers = (fed_loop.__code__,)  # as auto.py records at the first root forward
    for _ in batches(b):
        break


def test_the_loop_resuming_its_generator_is_an_input_sample() -> None:
    with Blocked(fed_loop) as b:
        s = StackSampler(b.probe, classifier_for(torch)).sample()
    assert s is not None and s.phase == OTHER and s.input, s


def warm_then_blocked(b: Blocked, n: int) -> Iterator[int]:
    for i in range(n):
        if i == n - 1:
            b.ready.set()
            b.release.wait(10)  # the generator's work, past the call's specialisation
        yield i


def pulled_loop(b: Blocked) -> None:
    assert b.probe is not None
    b.probe.callers = (pulled_loop.__code__,)
    src = warm_then_blocked(b, 200)
    for _ in range(200):
        x = next(src)  # issue 39: a micro-batch pulled by hand, as `x, y = next(src)`
        del x


def summed_loop(b: Blocked) -> None:
    assert b.probe is not None
    b.probe.callers = (summed_loop.__code__,)
    total = sum(wait_in(b))  # resumed from the loop's frame too, but by sum(): not the loop's input
    del total


def test_the_loop_pulling_a_batch_with_next_is_an_input_sample() -> None:
    with Blocked(pulled_loop) as b:
        s = StackSampler(b.probe, classifier_for(torch)).sample()
    assert s is not None and s.phase == OTHER and s.input, s
    with Blocked(summed_loop) as b:
        s = StackSampler(b.probe, classifier_for(torch)).sample()
    assert s is not None and s.phase == OTHER and not s.input, s


def train_step(b: Blocked) -> None:
    """Stands for the function that calls the model."""


def loop_calling_a_step_function(b: Blocked) -> None:
    assert b.probe is not None
    # as auto.py records: the model called from train_step, called from this loop
    b.probe.callers = (train_step.__code__, loop_calling_a_step_function.__code__)
    for _ in batches(b):
        train_step(b)
        break  # one batch (sampled while it is fetched): else, released, this loop spins for good


def test_the_loop_may_call_the_model_through_a_step_function() -> None:
    with Blocked(loop_calling_a_step_function) as b:
        s = StackSampler(b.probe, classifier_for(torch)).sample()
    assert s is not None and s.input, s


def loop_elsewhere(b: Blocked) -> None:
    assert b.probe is not None
    b.probe.callers = (line_of.__code__,)  # the model is called from another function
    for _ in batches(b):
        break


def test_a_generator_resumed_by_another_function_is_not_input() -> None:
    with Blocked(loop_elsewhere) as b:
        s = StackSampler(b.probe, classifier_for(torch)).sample()
    assert s is not None and not s.input, s


def _sample(t: float, site: str, caller: str = "", input: bool = False) -> tuple[float, StackSample]:
    return t, StackSample(int(t * 1e9), OTHER, site, "", False, False, caller, input)


def test_the_fold_sums_a_functions_lines_and_moves_input_to_data() -> None:
    steps = [StepRecord(0, 0.0, int(10e9), {"forward": int(2e9), "other": int(8e9)})]
    samples = [
        _sample(0.1 * k, f"/u/t.py:{20 + k % 4} helper.<locals>.<genexpr>", "/u/t.py:50 main")
        for k in range(12)
    ]
    samples += [_sample(2 + 0.1 * k, "/u/t.py:48 main", "/u/t.py:60 <module>") for k in range(5)]
    samples += [_sample(4 + 0.1 * k, "/u/t.py:10 batches", "/u/t.py:45 main", True) for k in range(8)]
    fo = fold(samples, steps)
    top = fo.functions["other"][0]
    assert top.site.endswith(" helper") and top.caller == "/u/t.py:50 main", top  # named by function
    assert top.samples == 12 and top.share == pytest.approx(12 / 17)
    # by line, the loop's own line heads (5 samples): each of the helper's lines has 3
    assert fo.host_sites["other"][0].site == "/u/t.py:48 main" and fo.host_sites["other"][1].samples == 3
    assert fo.inputs == 8 and fo.input_sites[0].site == "/u/t.py:10 batches"
    shares, moved = with_input_wait({"data": 0.0, "forward": 0.2, "other": 0.8}, fo, 8)
    assert moved == pytest.approx(0.8 * 8 / 25) and shares["data"] == pytest.approx(moved)
    assert shares["other"] == pytest.approx(0.8 - moved)
    assert with_input_wait({"other": 0.8}, fo, 9) == ({"other": 0.8}, 0.0)  # too few samples
