"""Agents only in the processes that train: an mp.spawn launcher and its ranks' spawned
DataLoader workers (the imagenet example's `--multiprocessing-distributed` shape) under
TORCHTOP=1 / `torchtop run`: `ls`, `report` and the chooser see the two ranks and nothing else."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgspec
import psutil
import pytest

from torchtop.contract import discovery
from torchtop.monitor.commands.run import child_env

pytestmark = [pytest.mark.slow]

SPAWNING = textwrap.dedent(
    """
    import os, sys, time, torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from torch.utils.data import DataLoader, TensorDataset

    def main_worker(rank, world, port, seconds):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        data = DataLoader(TensorDataset(torch.randn(64, 16)), batch_size=8, num_workers=1,
                          multiprocessing_context="spawn", persistent_workers=True)
        steps = int(seconds / 0.02)
        done = 0
        while done < steps:  # a count, not a deadline: DDP ranks run the same iterations
            for (x,) in data:
                model(x).sum().backward(); opt.step(); opt.zero_grad(); time.sleep(0.02)
                done += 1
                if done >= steps:
                    break
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(main_worker, args=(2, int(sys.argv[1]), float(sys.argv[2])), nprocs=2)
    """
)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _family(pid: int) -> dict[int, str]:
    """pid -> command line of the launcher and every descendant."""
    out = {}
    for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        try:
            out[p.pid] = " ".join(p.cmdline())
        except psutil.Error:
            pass
    return out


def test_a_spawning_launcher_and_its_loader_workers_get_no_listed_agent(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    script = tmp_path / "spawning.py"
    script.write_text(SPAWNING)
    env = child_env(None, subprocess_env)  # what `torchtop run` gives the job
    job = subprocess.Popen(
        [sys.executable, str(script), str(_free_port()), "40"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        agents: list[discovery.AgentInfo] = []
        while time.monotonic() < deadline and job.poll() is None:
            agents = discovery.list_agents()
            if sorted(a.rank or 0 for a in agents if a.world_size == 2) == [0, 1]:
                break  # both ranks listed (and whatever else is)
            time.sleep(0.3)
        assert job.poll() is None, job.stdout.read() if job.stdout else ""
        time.sleep(3.0)  # the loader workers and anything else had their chance to show up
        family = _family(job.pid)
        workers = [pid for pid, cmd in family.items() if "multiprocessing" in cmd and pid != job.pid]
        assert len(workers) >= 4, family  # 2 ranks + their spawned loader workers run
        agents = discovery.list_agents()
        pids = sorted(a.pid or 0 for a in agents)
        ranks = sorted(a.rank or 0 for a in agents)
        assert ranks == [0, 1], agents
        assert job.pid not in pids  # the launcher only spawns
        assert all(family.get(pid) for pid in pids)
        # the ranks' loader workers are their children: none of them is listed
        rank_children = {c.pid for pid in pids for c in psutil.Process(pid).children(recursive=True)}
        assert rank_children and not rank_children & set(pids)
        ls = subprocess.run(
            [sys.executable, "-m", "torchtop.monitor.commands.cli", "ls"],
            capture_output=True, text=True, timeout=60, env=subprocess_env,
        )  # fmt: skip
        assert ls.returncode == 0, ls.stderr
        assert str(job.pid) not in ls.stdout and "2 of 2 ranks" in ls.stdout, ls.stdout
        report = subprocess.run(
            [sys.executable, "-m", "torchtop.monitor.commands.cli", "report", "--seconds", "2"],
            capture_output=True, text=True, timeout=120, env=subprocess_env,
        )  # fmt: skip
        assert report.returncode == 0, report.stderr  # one job: not "N jobs run on this machine"
        assert sorted(e["rank"] for e in json.loads(report.stdout)["ranks"]) == [0, 1]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, 9)
        job.wait(30)


def test_a_loader_worker_never_starts_an_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch sets the worker info in a DataLoader worker: start() there is a no-op."""
    import torch.utils.data._utils.worker as worker

    import torchtop.agent

    monkeypatch.setattr(worker, "_worker_info", object())
    assert torchtop.agent.start() is None
    assert torchtop.agent.current() is None and discovery.list_agents() == []


def test_a_zero_code_agent_is_listed_once_its_model_runs() -> None:
    import torch

    import torchtop.agent

    agent = torchtop.agent.start(publish_when_active=True)
    assert agent is not None
    try:
        time.sleep(1.0)
        assert discovery.list_agents() == []  # imported torch, ran nothing: a launcher, a helper
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        deadline = time.monotonic() + 20
        while not discovery.list_agents() and time.monotonic() < deadline:
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            time.sleep(0.05)
        (entry,) = discovery.list_agents()
        assert entry.pid == os.getpid()
    finally:
        torchtop.agent.stop()


def test_the_chooser_never_shows_two_identical_rows() -> None:
    from torchtop.monitor.tui.widgets.chooser import choice_rows

    entry = discovery.AgentInfo(pid=11, start_time=5.0, rank=0, argv=["train.py"], address="ipc:///x.req")
    entry.pub_address = "ipc:///x.pub"
    other = msgspec.structs.replace(entry, pid=12, address="ipc:///y.req", pub_address="ipc:///y.pub")
    rows = choice_rows([entry, msgspec.structs.replace(entry), other])
    assert [k for _, k in rows] == [0, 2]  # the entry listed twice shows once
    assert len({row for row, _ in rows}) == len(rows)


def test_torch_compiles_worker_processes_start_no_agent() -> None:
    """inductor's compile workers run torch/_inductor/compile_worker/__main__.py: helpers, never a rank."""
    import torch._inductor.compile_worker as worker

    from torchtop.agent.autostart import is_launcher

    assert is_launcher([os.path.join(os.path.dirname(worker.__file__), "__main__.py"), "--workers=4"])
