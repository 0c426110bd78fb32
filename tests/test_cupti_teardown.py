"""A capture leaves nothing behind: our profiler sessions end with TEARDOWN_CUPTI=1 set before the
step at which their schedule stops the trace, and left set (Kineto reads it again after the
session), never where CUDA graphs are in use or the run (or torch) decided otherwise."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import TYPE_CHECKING, cast

import pytest

from torchtop.agent.capture import cupti

if TYPE_CHECKING:
    from torchtop.agent.hooks.probe import Probe

torch = pytest.importorskip("torch")


class Prof:
    """A profiler whose step() (where a schedule stops the trace) and stop() note what Kineto
    would read then."""

    def __init__(self) -> None:
        self.seen: str | None = "not stopped"
        self.at_step: str | None = "no step"

    def step(self) -> None:
        self.at_step = os.environ.get("TEARDOWN_CUPTI")

    def stop(self) -> None:
        self.seen = os.environ.get("TEARDOWN_CUPTI")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    before = os.environ.get("TEARDOWN_CUPTI")
    for name in ("TEARDOWN_CUPTI", "DISABLE_CUPTI_LAZY_REINIT", "TORCHTOP_CUPTI_TEARDOWN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cupti, "_ours", False)
    yield
    os.environ.pop("TEARDOWN_CUPTI", None)  # ours stays set by design: not for the tests after these
    if before is not None:
        os.environ["TEARDOWN_CUPTI"] = before


def test_a_cuda_session_of_ours_ends_with_cupti_torn_down_and_the_setting_stays() -> None:
    """Set for the call only, Kineto's teardown thread found it gone and re-subscribed CUPTI's
    callbacks: a capture left the launch-bound loop +21.6% slower (docs/benchmarks.md)."""
    prof = Prof()
    assert cupti.stop(prof, torch, cuda_activity=True, last_step=True) == ""
    assert prof.at_step == "1" and prof.seen == "1"  # the schedule's last step stops the trace
    assert os.environ["TEARDOWN_CUPTI"] == "1"
    again = Prof()  # a second capture of ours: the setting is ours, not "set already"
    assert cupti.stop(again, torch, cuda_activity=True, last_step=True) == ""


def test_our_setting_goes_when_a_later_session_may_not_tear_down(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cupti.stop(Prof(), torch, cuda_activity=True) == ""
    monkeypatch.setitem(sys.modules, "torch._inductor.cudagraph_trees", SimpleNamespace())
    prof = Prof()
    assert "reduce-overhead" in cupti.stop(prof, torch, cuda_activity=True, last_step=True)
    assert prof.at_step is None and "TEARDOWN_CUPTI" not in os.environ


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ({"TEARDOWN_CUPTI": "0"}, "TEARDOWN_CUPTI=0 is set already"),
        ({"DISABLE_CUPTI_LAZY_REINIT": "1"}, "DISABLE_CUPTI_LAZY_REINIT"),
        ({"TORCHTOP_CUPTI_TEARDOWN": "0"}, "TORCHTOP_CUPTI_TEARDOWN=0"),
    ],
)
def test_the_environment_can_keep_cupti(monkeypatch: pytest.MonkeyPatch, env: dict, reason: str) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    prof = Prof()
    assert reason in cupti.stop(prof, torch, cuda_activity=True)
    assert prof.seen == env.get("TEARDOWN_CUPTI")  # untouched: theirs, or unset
    assert os.environ.get("TEARDOWN_CUPTI") == env.get("TEARDOWN_CUPTI")


def test_no_teardown_without_cuda_activity() -> None:
    prof = Prof()
    assert "no CUDA activity" in cupti.stop(prof, torch, cuda_activity=False)
    assert prof.seen is None


def test_no_teardown_while_cuda_graphs_are_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config.triton, "cudagraphs", True)
    assert "CUDA graphs are on" in cupti.teardown_refusal(torch, cuda_activity=True)
    monkeypatch.setattr(inductor_config.triton, "cudagraphs", False)
    monkeypatch.setitem(sys.modules, "torch._inductor.cudagraph_trees", SimpleNamespace())
    assert "reduce-overhead" in cupti.teardown_refusal(torch, cuda_activity=True)
    monkeypatch.delitem(sys.modules, "torch._inductor.cudagraph_trees")
    capturing = SimpleNamespace(
        cuda=SimpleNamespace(is_available=lambda: True, is_current_stream_capturing=lambda: True)
    )
    assert "being captured" in cupti.teardown_refusal(capturing, cuda_activity=True)


def test_the_capture_controller_stops_its_profiler_through_the_rule(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.agent_util import CaptureProbe
    from torchtop.agent.capture.controller import CaptureController
    from torchtop.agent.cuda_use import CudaUse

    monkeypatch.setenv("TORCHTOP_DIR", str(tmp_path / "captures"))
    seen: list[bool] = []
    real = cupti.stop
    monkeypatch.setattr(
        cupti,
        "stop",
        lambda prof, t, cuda, last_step=False: (
            seen.append(cuda and last_step) or real(prof, t, cuda, last_step)
        ),
    )
    probe = CaptureProbe()
    c = CaptureController(CudaUse(torch), cast("Probe", probe))  # the part of a Probe it uses
    c.request("capture-profile", {"steps": 1})
    probe.on_step()  # the profiler starts at a boundary...
    torch.nn.Linear(4, 4)(torch.randn(2, 4)).sum().backward()
    probe.on_step()  # ...and stops at the next
    on_gpu = torch.cuda.is_available()  # a CUDA session is torn down at its last step; a CPU one has no CUPTI
    assert seen == [on_gpu]
    assert c.cupti_kept == ("" if on_gpu else "no CUDA activity was recorded")
    assert not torch.autograd._profiler_enabled()
    assert os.environ.get("TEARDOWN_CUPTI") == ("1" if on_gpu else None)
