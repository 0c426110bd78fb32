"""Recording a real run (real agent, real torch on CPU): every step kept, the live report's
figures read back from the file, a killed run losing at most the last second, a monitor's own
recording (`attach --record`)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from tests.agent_util import endpoint_for, mlp, tensor_loader, train
from torchtop.contract import wire
from torchtop.monitor.commands.cli import main
from torchtop.monitor.commands.launch import wait_for_agents
from torchtop.monitor.diagnosis.report import build_report
from torchtop.monitor.link.client import AgentClient
from torchtop.monitor.link.record import MonitorRecorder
from torchtop.monitor.link.targets import Endpoint, from_discovery
from torchtop.monitor.model.playback import load
from torchtop.monitor.model.state import RunState
from torchtop.monitor.tui.feed import run_feed

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread_warm_torch")]

CHILD = """
import sys, time, torch
sys.path.insert(0, {root!r})
torch.set_num_threads(1)
import torchtop.agent as ta
from tests.agent_util import endpoint_for, mlp, tensor_loader, train
agent = ta.start(record={record!r})
assert agent is not None and agent.recorder is not None
mode, seconds = sys.argv[1], float(sys.argv[2])
if mode == "watched":  # train only once a monitor listens: it sees the run from its first step
    while not agent.loop.subscribed:
        time.sleep(0.02)
    time.sleep(1.0)
model, steps, end = mlp(), 0, time.monotonic() + seconds
while time.monotonic() < end:
    steps += train(model, tensor_loader(20))
    print("steps", steps, time.time(), flush=True)
ta.stop()
"""


def child(tmp_path: Path, record: Path, mode: str, seconds: float, env: dict[str, str]) -> subprocess.Popen:
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(root=str(Path(__file__).resolve().parent.parent), record=str(record)))
    return subprocess.Popen(
        [sys.executable, str(script), mode, str(seconds)], env=env, stdout=subprocess.PIPE, text=True
    )


def test_a_recorded_run_replays_with_every_step(tmp_path: Path) -> None:
    import torchtop.agent as ta

    agent = ta.start(record=tmp_path)
    assert agent is not None and agent.recorder is not None
    model, steps, end = mlp(), 0, time.monotonic() + 2.5
    while time.monotonic() < end:  # a few host samples (1 Hz) and unattended ticks (2 Hz)
        steps += train(model, tensor_loader(40))
    ta.stop()
    playback, ranks = load(tmp_path)
    assert list(ranks) == [0] and playback.warnings == []
    got = [s for p in playback.play() for s in p.steps if s.kind == "train"]
    assert [s.i for s in got] == list(range(steps))
    assert all(s.phases and sum(s.phases.values()) == s.wall_ns for s in got)  # every step timed here
    assert playback.hello is not None and playback.hello.pid == os.getpid()
    host = [
        m.telemetry.host
        for m in playback.messages
        if isinstance(m, wire.Batch) and m.telemetry and m.telemetry.host
    ]
    assert host and host[-1].proc_rss_peak >= host[-1].proc_rss > 0
    # nobody watched, yet the recording holds stack samples: its report names the hot code
    state = playback.state_until(None)
    assert len(state.why.samples) >= 3, len(state.why.samples)
    report = build_report(state, float("inf"), str(tmp_path), window=float("inf"))
    assert report["hot_functions"], report["stack_samples"]


def watch(endpoint: Endpoint, seconds: float, timeout: float = 120.0) -> RunState:
    """A live monitor's state (as `torchtop report` collects it) once the run has trained for
    `seconds` while it watched: a loaded machine may take a while to start training."""
    client = AgentClient(endpoint)
    state = RunState()
    try:
        state.apply_hello(client.hello())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for got in client.recv_batches(0.5):
                state.apply_batch(got.batch, got.steps, time.monotonic(), got.log_errors)
            if state.steps and state.agent_time - state.steps[0].t0 > seconds:
                return state
        raise AssertionError(f"the run did not train for {seconds} s within {timeout} s")
    finally:
        client.close()


def test_report_file_equals_the_live_report(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    """A monitor watches the run from its first step until it has trained for 5 s; `report FILE
    --until` its last batch gives the same JSON over the last 4 s (the target and the batch
    count aside: the file has the batches recorded before anyone listened too; events are the
    command's own, rebuilt from the file)."""
    record = tmp_path / "run"
    proc = child(tmp_path, record, "watched", 120.0, subprocess_env)
    try:
        (info,) = wait_for_agents(proc, timeout=60)
        live_state = watch(from_discovery(info), 5.0)
        live = build_report(live_state, 4.0, "live")
    finally:
        proc.kill()
        proc.wait(10)
    assert live["steps"] > 50 and live_state.gaps == 0
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["report", str(record), "--seconds", "4", "--until", repr(live_state.agent_time)]) == 0
    from_file = json.loads(out.getvalue())
    # events are the CLI's (judged a second at a time as it collects or replays): build_report has none
    for key in ("target", "batches", "events"):
        live.pop(key)
        from_file.pop(key)
    assert from_file == live


def test_a_killed_run_loses_at_most_the_last_second(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    record = tmp_path / "run"
    proc = child(tmp_path, record, "alone", 60.0, subprocess_env)
    assert proc.stdout is not None
    first: float | None = None
    said = 0.0  # the wall clock of the run's last progress line
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline().split()
            if len(line) == 3:  # "steps N wall-clock": three seconds of training, nobody watching
                said = float(line[2])
                first = first or said
                if said - first >= 3.0:
                    break
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        # its lines up to the kill, still in the pipe: how far the run had trained, as it saw it
        # (the kill's own time would count too any seconds a loaded machine held the whole run,
        # agent included, off the CPU just before)
        rest = [w for w in map(str.split, proc.stdout.read().splitlines()) if len(w) == 3]
        said = max([said] + [float(w[2]) for w in rest])
    finally:
        proc.kill()
    playback, _ = load(record)
    steps = [s for p in playback.play() for s in p.steps]
    assert first is not None and steps, "nothing recorded of three seconds of training"
    last_end = steps[-1].t0 + steps[-1].wall_ns / 1e9
    assert said - last_end < 1.0, f"the recording ends {said - last_end:.2f} s before the run's last line"
    assert [s.i for s in steps] == list(range(len(steps)))
    cut = [w for w in playback.warnings if "recording cut at" in w]  # the kill is said, with where
    assert len(cut) == 1 and "after step " in cut[0] and "the run was killed?" in cut[0], cut


def test_a_monitor_records_what_it_receives(tmp_path: Path) -> None:
    import torchtop.agent as ta

    agent = ta.start()
    assert agent is not None
    posted: list[object] = []
    stop = threading.Event()
    recorder = MonitorRecorder(tmp_path / "seen")
    feed = threading.Thread(
        target=run_feed,
        args=(endpoint_for(agent), posted.append, stop.is_set),
        kwargs={"recorder": recorder},
    )
    feed.start()
    try:
        deadline = time.monotonic() + 10
        while not agent.loop.subscribed and time.monotonic() < deadline:
            time.sleep(0.02)
        model = mlp()
        steps = sum(train(model, tensor_loader(40)) for _ in range(5))

        # the last batch reaches the monitor: the agent's tick slows to keep its cost a share of
        # the time (loop.py TICK_SHARE), so wait for what the monitor was sent, not a fixed time
        def seen() -> int:
            return sum(len(r.steps) for p in list(posted) for r in getattr(p, "batches", []))

        while seen() < steps and time.monotonic() < deadline + 20:
            time.sleep(0.05)
        time.sleep(0.2)  # the recorder wrote what the feed posted
    finally:
        stop.set()
        feed.join(5)
    playback, _ = load(tmp_path / "seen")
    got = [s.i for p in playback.play() for s in p.steps if s.kind == "train"]
    assert got == list(range(steps))
    assert playback.hello is not None and playback.hello.run_id == agent.run_id


@pytest.mark.cuda
def test_a_recorded_cuda_run_keeps_device_times_and_memory(tmp_path: Path) -> None:
    import torch

    import torchtop.agent as ta

    agent = ta.start(record=tmp_path)
    assert agent is not None
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)
    ).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(256, 1024, device="cuda"), torch.randint(0, 10, (256,), device="cuda")
    steps, end = 0, time.monotonic() + 4
    while time.monotonic() < end:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
    torch.cuda.synchronize()
    ta.stop()
    playback, _ = load(tmp_path)
    got = [s for p in playback.play() for s in p.steps if s.kind == "train"]
    assert [s.i for s in got] == list(range(steps))
    assert any(s.device_ms for s in got)  # CUDA-event times of the sampled steps
    assert playback.hello is not None and playback.hello.device == "cuda"
    memory = [
        m.telemetry.memory
        for m in playback.messages
        if isinstance(m, wire.Batch) and m.telemetry and m.telemetry.memory
    ]
    assert memory and memory[-1][0].peak_allocated > 0
