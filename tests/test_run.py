"""Zero-code: `torchtop run -- ...` and TORCHTOP=1 on scripts that never mention torchtop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.agent_util import free_port
from torchtop.agent.autostart import is_launcher
from torchtop.contract import discovery
from torchtop.monitor.commands.run import child_env, job_name

pytestmark = [pytest.mark.slow, pytest.mark.phase_sampling]  # subprocesses; the default policy, end to end

TRAIN = textwrap.dedent(
    """
    import os, sys, time, torch
    from torch.utils.data import DataLoader, TensorDataset
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = DataLoader(TensorDataset(torch.randn(512, 32), torch.randint(0, 4, (512,))), batch_size=8)
    end = time.time() + float(sys.argv[1])
    stop = sys.argv[3] if len(sys.argv) > 3 else None  # a file: the test's word to finish early
    while time.time() < end and not (stop and os.path.exists(stop)):
        for x, y in data:
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.005)
    print("trained", flush=True)
    sys.exit(int(sys.argv[2]))
    """
)


def _torchtop(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torchtop.monitor.commands.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        **kw,
    )


def _wait_steps(agent: discovery.AgentInfo, n: int, timeout: float = 60) -> None:
    from torchtop.monitor.link.client import AgentClient
    from torchtop.monitor.link.targets import from_discovery

    client = AgentClient(from_discovery(agent))
    try:
        deadline = time.monotonic() + timeout
        while len(client.snapshot().steps) < n:
            assert time.monotonic() < deadline, f"fewer than {n} steps after {timeout} s"
            time.sleep(0.2)
    finally:
        client.close()


def _wait_agents(n: int, timeout: float = 90) -> list[discovery.AgentInfo]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        agents = discovery.list_agents()
        if len(agents) >= n:
            return agents
        time.sleep(0.2)
    raise AssertionError(f"{len(discovery.list_agents())} agents after {timeout} s, wanted {n}")


def test_unmodified_script_under_run_no_tui(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    stop = tmp_path / "stop"  # the job trains until the report is in (a loaded machine starts it late)
    job = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torchtop.monitor.commands.cli",
            "run",
            "--no-tui",
            "--",
            sys.executable,
            str(script),
            "120",
            "3",
            str(stop),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        (agent,) = _wait_agents(1)
        assert agent.argv is not None and agent.argv[0] == str(script)
        _wait_steps(agent, 20)  # the agent starts at `import torch`, before the model exists
        out = _torchtop("report", "--seconds", "2")
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        assert report["steps"] > 5
        assert report["breakdown"]["forward"] > 0 and report["breakdown"]["backward"] > 0
        assert report["breakdown"]["data"] > 0 and report["breakdown"]["optimizer"] > 0
        stop.touch()
        stdout, stderr = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 3  # the job's own exit code
    assert "trained" in stdout  # its output stays on this terminal with --no-tui
    assert "torchtop attach" in stderr


def test_module_form_and_chained_sitecustomize(tmp_path: Path) -> None:
    (tmp_path / "train_mod.py").write_text(TRAIN)
    site = tmp_path / "site"
    site.mkdir()
    marker = tmp_path / "their-sitecustomize-ran"
    (site / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').write('yes')\n")
    env = dict(os.environ, PYTHONPATH=str(site))
    job = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torchtop.monitor.commands.cli",
            "run",
            "--no-tui",
            "--",
            sys.executable,
            "-m",
            "train_mod",
            "6",
            "0",
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        (agent,) = _wait_agents(1)
        assert agent.argv is not None and agent.argv[0].endswith("train_mod.py")
        job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0
    assert marker.read_text() == "yes"  # the environment's own sitecustomize still ran


def test_torchtop_env_starts_the_agent_in_plain_python(tmp_path: Path) -> None:
    if not any((Path(p) / "torchtop_autostart.pth").exists() for p in sys.path if p):
        pytest.skip("torchtop is not installed here with its .pth (run from a bare checkout)")
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    job = subprocess.Popen(
        [sys.executable, str(script), "6", "0"],
        env=dict(os.environ, TORCHTOP="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        (agent,) = _wait_agents(1)
        assert agent.pid == job.pid
    finally:
        job.communicate(timeout=60)
    assert job.returncode == 0


def test_no_agent_without_the_variable(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    env = {k: v for k, v in os.environ.items() if k != "TORCHTOP"}
    out = subprocess.run(
        [sys.executable, str(script), "1", "0"], env=env, capture_output=True, text=True, timeout=60
    )
    # the agent's own lines start "torchtop:" (agent/warn.py); the bare word can be in a warning's
    # path (a clone in a folder named torchtop, torch's "numpy not found" line)
    assert out.returncode == 0 and "torchtop:" not in out.stderr, out.stderr
    assert discovery.list_agents() == []


def test_torchrun_ranks_get_agents_not_the_launcher(tmp_path: Path) -> None:
    script = tmp_path / "ddp.py"
    script.write_text(
        textwrap.dedent(
            """
        import time, torch, torch.distributed as dist
        dist.init_process_group("gloo")
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(1000):  # a count, not a deadline: DDP ranks must run the same iterations
            model(torch.randn(8, 16)).sum().backward(); opt.step(); opt.zero_grad(); time.sleep(0.01)
        dist.destroy_process_group()
        """
        )
    )
    job = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torchtop.monitor.commands.cli",
            "run",
            "--no-tui",
            "--",
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            str(script),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        agents = _wait_agents(2)
        time.sleep(2)  # a launcher agent, if one started, would show by now
        agents = discovery.list_agents()
        assert sorted(a.rank or 0 for a in agents) == [0, 1]
        assert all(a.world_size == 2 for a in agents)
        rank1 = next(a for a in agents if a.rank == 1)
        out = _torchtop("report", str(rank1.pid), "--seconds", "2")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["ranks"] == [1]
        _, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, err[-3000:]


def test_ctrl_c_reaches_the_job_and_its_code_comes_back(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    job = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torchtop.monitor.commands.cli",
            "run",
            "--no-tui",
            "--",
            sys.executable,
            str(script),
            "60",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _wait_agents(1)
        os.killpg(job.pid, signal.SIGINT)  # what the terminal does on Ctrl-C: the whole group
        _, stderr = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 130, stderr  # Python's KeyboardInterrupt exit, passed through
    assert "KeyboardInterrupt" in stderr


def test_bad_input() -> None:
    out = _torchtop("run", "--no-tui")
    assert out.returncode == 2 and "after --" in out.stderr
    out = _torchtop("run", "--no-tui", "--", "/no/such/program")
    assert out.returncode == 127 and "cannot run" in out.stderr


def test_helpers() -> None:
    assert is_launcher(["/usr/bin/torchrun", "--nproc_per_node", "2", "x.py"])
    assert is_launcher([os.path.join("site-packages", "torch", "distributed", "run.py"), "x.py"])
    assert not is_launcher(["train.py"])
    assert is_launcher(
        ["-m", "--nproc_per_node", "2"], ["python", "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    )
    assert not is_launcher(["-m"], ["python", "-m", "pkg.train"])
    env = child_env(5555, {"PYTHONPATH": "/a"})
    assert env["TORCHTOP"] == "1" and env["TORCHTOP_PORT"] == "5555"
    assert (
        env["PYTHONPATH"].endswith(os.pathsep + "/a")
        and (Path(env["PYTHONPATH"].split(os.pathsep)[0]) / "sitecustomize.py").exists()
    )
    assert "TORCHTOP_RECORD" not in env
    assert child_env(None, {}, record="runs/x")["TORCHTOP_RECORD"] == str(Path("runs/x").resolve())
    assert job_name(["python", "-m", "pkg.train"]) == "pkg_train"
    assert job_name(["python", "/x/train.py", "--lr", "1"]) == "train"


async def test_log_tab_follows_the_job_output(tmp_path: Path) -> None:
    from tests.tui_util import wait_for
    from torchtop.monitor.tui.app import TorchtopApp

    log = tmp_path / "job.log"
    log.write_text("epoch 1\nstep 10 loss 2.3\n")
    app = TorchtopApp(None, None, feed=False, log_path=log)
    tail = app.log_tail
    assert tail is not None
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("4")
        # the tail reads the file every 0.5 s: wait for what it shows (a loaded machine runs the
        # app's timer late), not a fixed time
        shown = await wait_for(pilot, lambda: tail.lines[:2] == ["epoch 1", "step 10 loss 2.3"], 30)
        assert shown, tail.lines
        with open(log, "a") as fh:
            fh.write("step 20 loss 1.9\npartial")
        assert await wait_for(pilot, lambda: "step 20 loss 1.9" in tail.lines, 30), tail.lines
        assert tail.lines[-1] == "step 20 loss 1.9"  # the unfinished line waits for its end
