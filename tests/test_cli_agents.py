"""The command line against real agents: `torchtop report` / `ls` / `attach`, run as a user would run them.

A training script in another process (and an in-process agent) for the good cases; bad targets,
dead pids and stale discovery files end in exit code 2 and one line on stderr.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests.agent_util import free_port_pair  # noqa: E402
from torchtop.contract import discovery  # noqa: E402
from torchtop.contract.logcodes import PHASES  # noqa: E402
from torchtop.monitor.link.client import AgentClient  # noqa: E402
from torchtop.monitor.link.targets import from_discovery  # noqa: E402

CLI = [sys.executable, "-m", "torchtop.monitor.commands.cli"]


# -- the command line against a training run in another process ---------------------------------
TRAINING_SCRIPT = """
import os, sys, time
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
import torchtop.agent

torch.set_num_threads(1)

class Slow(Dataset):
    def __len__(self):
        return 100_000
    def __getitem__(self, i):
        time.sleep(0.008)
        return torch.randn(8, 16), torch.randint(0, 2, (8,))

assert torchtop.agent.start() is not None
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
end = time.monotonic() + float(sys.argv[1])
for x, y in DataLoader(Slow(), batch_size=None):
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    if time.monotonic() > end:
        break
"""


@pytest.fixture(params=["ipc", "tcp"])
def training_run(tmp_path: Path, runtime_dir: Path, request: pytest.FixtureRequest):
    """A training script with the agent, in its own process; yields its discovery info. On ipc
    sockets (the default), or on TCP when a port is asked for."""
    script = tmp_path / "train.py"
    script.write_text(TRAINING_SCRIPT)
    env = dict(os.environ)
    if request.param == "tcp":
        env["TORCHTOP_PORT"] = str(free_port_pair())
    proc = subprocess.Popen([sys.executable, str(script), "60"], stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stderr is not None  # piped
    try:
        path = runtime_dir / f"agent-{proc.pid}.json"
        deadline = time.monotonic() + 60
        while not path.exists():
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the agent never wrote its discovery file"
            time.sleep(0.05)
        info = discovery.entry(json.loads(path.read_text()))
        # wait until it trains, not just until the agent is up (first steps are slow on a busy machine)
        c = AgentClient(from_discovery(info))
        try:
            while len(c.snapshot().steps) < 5:
                assert proc.poll() is None, proc.stderr.read()
                assert time.monotonic() < deadline, "the training script never stepped"
                time.sleep(0.1)
        finally:
            c.close()
        yield info
    finally:
        proc.kill()
        proc.wait()


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def check_report(stdout: str, pid: int) -> dict:
    lines = stdout.strip().splitlines()
    assert len(lines) == 1, stdout  # ONE JSON object
    report = json.loads(lines[0])
    assert isinstance(report, dict)
    try:
        _check_report(report, pid)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nreport: {json.dumps(report, indent=1)}") from None
    return report


def _check_report(report: dict, pid: int) -> None:
    assert report["pid"] == pid
    assert report["device"] == "cpu"
    assert report["ranks"] == [0]
    assert report["dropped"] == 0 and report["gaps"] == 0
    assert report["steps"] >= 10  # ~100 steps a second for 2 s, on a loaded machine far fewer
    st = report["step_time_ms"]
    assert 8.0 <= st["median"] <= st["p90"]  # every step waits 8 ms for data
    shares = report["breakdown"]
    assert set(shares) == set(PHASES)  # every phase, checkpoint included (contract/logcodes.py)
    assert sum(shares.values()) == pytest.approx(1.0, abs=1e-3)
    assert all(v >= 0 for v in shares.values())
    assert shares["data"] > 0.5  # the run is data-bound, and the report says so
    assert shares["forward"] > 0 and shares["backward"] > 0 and shares["optimizer"] > 0
    assert shares["h2d"] == 0


@pytest.mark.slow  # a training subprocess
def test_report_and_ls_against_a_running_training_process(training_run: discovery.AgentInfo) -> None:
    pid, port = training_run.pid, training_run.port
    assert pid is not None  # a live agent's entry
    if port:  # TCP: the loopback HOST:PORT forms find the CURVE keys in this user's discovery entry
        targets = [str(pid), f"127.0.0.1:{port}", f"tcp://127.0.0.1:{port}", f"localhost:{port}", None]
    else:
        targets = [str(pid), training_run.address, None]
    procs = [
        subprocess.Popen(
            [*CLI, "report", *([t] if t else []), "--seconds", "2"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for t in targets
    ]
    ls = cli("ls", "--json")
    assert ls.returncode == 0, ls.stderr
    (listed,) = json.loads(ls.stdout)
    assert listed["pid"] == pid and listed["address"] == training_run.address
    if port:
        assert listed["transport"] == "tcp" and listed["pub_port"] == port + 1
        assert listed["address"] == f"tcp://127.0.0.1:{port}" and listed["server_key"]
    else:
        assert listed["transport"] == "ipc" and listed["pub_address"].endswith(f"agent-{pid}.pub")
    assert any(arg.endswith("train.py") for arg in listed["argv"])
    plain = cli("ls")
    assert plain.returncode == 0 and f"pid {pid}" in plain.stdout
    assert (f"port {port}" if port else "  ipc  ") in plain.stdout

    for target, proc in zip(targets, procs):
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, (target, err)
        report = check_report(out, pid)
        assert report["seconds"] == 2


def test_ls_lists_an_in_process_agent(agent) -> None:
    out = cli("ls", "--json")
    assert out.returncode == 0, out.stderr
    (info,) = json.loads(out.stdout)
    assert (info["pid"], info["address"], info["run_id"]) == (
        os.getpid(),
        agent.sockets.address,
        agent.run_id,
    )


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout == ""
    err = proc.stderr.strip()
    assert "\n" not in err and err.startswith("torchtop: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err


@pytest.mark.slow  # one CLI subprocess per target
def test_bad_targets_exit_2_with_one_line(runtime_dir: Path) -> None:
    gone = dead_pid()
    closed = free_port_pair()
    slow = subprocess.Popen(
        [*CLI, "report", f"127.0.0.1:{closed}", "--seconds", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    one_line_error(cli("report", "no-such-thing"), "unknown target 'no-such-thing'")
    one_line_error(cli("report", "127.0.0.1:99999"), "out of range")
    one_line_error(cli("attach", "no-such-thing"), "unknown target", "ssh://[user@]host[/pid]")
    one_line_error(cli("report", str(gone)), f"no torchtop agent with pid {gone}")
    one_line_error(cli("attach", str(gone)), f"no torchtop agent with pid {gone}")
    one_line_error(cli("report", "--seconds", "0"), "--seconds", "above 0")
    # no agent at all
    one_line_error(cli("report", "--seconds", "1"), "no torchtop agent is running", str(runtime_dir))
    one_line_error(cli("attach"), "no torchtop agent is running")
    # a closed port: nobody answers
    out, err = slow.communicate(timeout=60)
    one_line_error(
        subprocess.CompletedProcess(slow.args, slow.returncode, out, err), "no answer", str(closed)
    )


# `torchtop attach ...` with the TUI imported first: it writes when it starts the command (the
# monotonic clock is the machine's), so the time its first hello takes is told apart from the
# seconds a loaded machine takes to start Python and import the TUI
TIMED_CLI = """
import sys, time
import torchtop.monitor.tui.app  # noqa: F401
from torchtop.monitor.commands import cli
with open(sys.argv[1], "w") as fh:
    fh.write(repr(time.monotonic()))
sys.exit(cli.main(sys.argv[2:]))
"""


@pytest.mark.slow
def test_attach_to_a_closed_or_wrong_port_ends_with_the_headless_error(
    runtime_dir: Path, tmp_path: Path
) -> None:
    """No TUI that waits forever: a first hello that never comes back within a few seconds is the
    one line `report` prints. The wrong port is a TCP listener that is no torchtop agent."""
    import socket

    closed = free_port_pair()
    started = tmp_path / "started"
    with socket.socket() as wrong:
        wrong.bind(("127.0.0.1", 0))
        wrong.listen()
        for port in (closed, wrong.getsockname()[1]):
            started.unlink(missing_ok=True)
            try:
                proc = subprocess.run(
                    [sys.executable, "-c", TIMED_CLI, str(started), "attach", f"127.0.0.1:{port}"],
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
            except subprocess.TimeoutExpired:
                pytest.fail(f"`torchtop attach 127.0.0.1:{port}` still waiting after 120 s")
            one_line_error(proc, "no answer from a torchtop agent", str(port))
            assert time.monotonic() - float(started.read_text()) < 20  # the command's own time


@pytest.mark.slow  # CLI subprocesses
def test_stale_discovery_file_is_skipped_and_removed(runtime_dir: Path) -> None:
    gone = dead_pid()
    stale = runtime_dir / f"agent-{gone}.json"
    stale.write_text(
        json.dumps({"pid": gone, "port": 40000, "pub_port": 40001, "start_time": 1.0, "bind": "127.0.0.1"})
    )
    broken = runtime_dir / "agent-1234567.json"
    broken.write_text("{not json")

    one_line_error(cli("report", str(gone)), f"no torchtop agent with pid {gone}")
    assert not stale.exists()

    stale.write_text(json.dumps({"pid": gone, "port": 40000}))
    out = cli("ls", "--json")
    assert out.returncode == 0 and json.loads(out.stdout) == []
    assert not stale.exists()

    stale.write_text(json.dumps({"pid": gone, "port": 40000}))
    one_line_error(cli("report", "--seconds", "1"), "no torchtop agent is running")
    assert not stale.exists()


def test_reused_pid_is_stale(runtime_dir: Path) -> None:
    """A discovery file whose pid now belongs to another process (started later) is stale."""
    me = os.getpid()
    path = runtime_dir / f"agent-{me}.json"
    path.write_text(json.dumps({"pid": me, "port": 40000, "proc_start": 1.0}))  # "started" in 1970
    assert discovery.list_agents() == []
    assert not path.exists()
