"""Training scripts nobody here wrote, run under TORCHTOP=1 and judged by `torchtop report` as a
user would see them (issue 18): each gets the verdict a person would give.

The scripts are in tests/loops/ (pytorch/examples' MNIST on random tensors, a generator doing
heavy preprocessing, gradient accumulation under CPU autocast, torch.compile, an IterableDataset,
train+eval); Lightning, the Hugging Face Trainer and torchrun DDP are in test_integrations.py and
test_run.py. Each script prints "warm" once past its first steps (and compilation); the report
then covers the next seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.sampled_phases]  # the default policy, end to end

LOOPS = Path(__file__).parent / "loops"
SEVERE = ("warning", "critical")


def _report(pid: int, seconds: float, *extra: str) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "torchtop.monitor.commands.cli",
        "report",
        str(pid),
        "--seconds",
        str(seconds),
    ]
    out = subprocess.run([*cmd, *extra], capture_output=True, text=True, timeout=seconds + 90)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


class Loop:
    """A tests/loops script running under TORCHTOP=1, its output read line by line."""

    def __init__(self, name: str, *args: str) -> None:
        env = dict(os.environ, TORCHTOP="1", PYTHONWARNINGS="ignore")
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, str(LOOPS / f"{name}.py"), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, text: str, timeout: float = 240.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = next((line for line in self.lines if text in line), None)
            if found is not None:
                return found
            if self.proc.poll() is not None:
                self._reader.join(5)
                raise AssertionError(f"exited {self.proc.returncode} before {text!r}: {self.lines[-20:]}")
            time.sleep(0.2)
        raise AssertionError(f"no {text!r} after {timeout} s: {self.lines[-20:]}")

    def report(self, seconds: float = 12.0, *extra: str) -> dict[str, Any]:
        self.wait_for("warm")
        r = _report(self.proc.pid, seconds, *extra)
        print(
            f"\n{self.proc.args[1]}: {r['steps']} steps, median {r['step_time_ms']['median']:.1f} ms, "
            f"breakdown {r['breakdown']}\n  verdict {r['verdict']}\n  flags {r['flag_details']}"
        )
        return r

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _run(name: str, *args: str, seconds: float = 12.0) -> dict[str, Any]:
    loop = Loop(name, *args)
    try:
        return loop.report(seconds)
    finally:
        loop.stop()


def _healthy(r: dict[str, Any]) -> None:
    """Compute bound, ok, no alarm; any small data wait is a note, not a headline or a flag."""
    assert r["verdict"]["kind"] == "compute" and r["verdict"]["severity"] == "ok", r["verdict"]
    assert not [f for f in r["flag_details"] if f["severity"] in SEVERE], r["flag_details"]
    assert "dataloader-workers" not in r["flags"], r["flag_details"]
    share = r["breakdown"]["data"]
    if share >= 0.05:
        assert any(line.startswith("note: data wait") for line in r["verdict"]["evidence"]), r["verdict"]


@pytest.mark.parametrize("name", ["mnist_like", "grad_accum_autocast", "iterable_dataset"])
def test_a_healthy_loop_is_called_healthy(name: str) -> None:
    _healthy(_run(name))


def test_a_compiled_loop_with_a_little_indexing_is_healthy() -> None:
    """Issue 18: "no DataLoader worker processes" flagged 1 ms of TensorDataset indexing (7%)."""
    _healthy(_run("compiled", "--seconds", "400"))


def test_a_loop_starved_by_its_generator_says_so() -> None:
    """Issue 18: data 0 ms, `other` 38.7 of 40.3 ms, headlined "Compute bound · ok"."""
    r = _run("generator_preprocess")
    v = r["verdict"]
    assert v["kind"] == "outside-phases" and v["severity"] in SEVERE, v
    assert r["breakdown"]["other"] >= 0.5 and r["breakdown"]["data"] == 0
    assert any("torchtop.agent.data(" in a for a in v["advice"]), v
    wrapped = _run("generator_preprocess", "--wrapped")  # as the advice says: now it is data wait
    assert wrapped["verdict"]["kind"] == "data-loading", wrapped["verdict"]
    assert wrapped["breakdown"]["data"] >= 0.5


def test_each_eval_forward_is_one_eval_step() -> None:
    """Issue 18: two identical runs of 15 passes x 16 no-grad forwards reported 16 and 32."""
    for _ in range(2):
        loop = Loop("train_eval", "--hold", "120")
        try:
            loop.wait_for("eval forwards 240")
            r = _report(loop.proc.pid, 1.0, "--history")
        finally:
            loop.stop()
        assert r["eval_steps"] == 240 and r["steps"] == 15 * 40, (r["eval_steps"], r["steps"])
