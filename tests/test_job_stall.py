"""Issue 35, "numbers that don't add up", end to end: a 2-rank mp.spawn (gloo) job whose DataLoader
worker restarts each epoch (a stall of seconds before each short epoch of fast, phase-sampled
steps: the stall is almost never one of the timed steps). The job's data share is within 10
points of each rank's own breakdown, the stall's data wait is in both (from its stack samples),
and the verdict's "X% of step time: A ms of B ms" adds up."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from torchtop.contract import discovery
from torchtop.monitor.commands import cli
from torchtop.monitor.commands.run import child_env

pytestmark = [pytest.mark.slow, pytest.mark.phase_sampling]

STALLING = textwrap.dedent(
    """
    import sys, time, torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from torch.utils.data import DataLoader, Dataset

    class Rows(Dataset):
        def __len__(self):
            return 300

        def __getitem__(self, i):
            return torch.randn(16)

    def opened(_):
        time.sleep(3.0)  # the worker opens its dataset: every epoch, as persistent_workers=False restarts it

    def main_worker(rank, world, port, seconds):
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        data = DataLoader(Rows(), batch_size=4, num_workers=1, multiprocessing_context="spawn",
                          persistent_workers=False, worker_init_fn=opened)
        end = time.time() + seconds
        while True:
            for x in data:
                model(x).sum().backward(); opt.step(); opt.zero_grad(); time.sleep(0.004)
            go = torch.tensor([float(time.time() < end)])
            dist.all_reduce(go)
            if go.item() < world:
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


def _line_adds_up(verdict: dict) -> None:
    for line in verdict["evidence"]:
        m = re.search(r"(\d+)% of step time: ([\d.]+) ms of ([\d.]+) ms", line)
        if m and float(m.group(3)) > 0:
            assert float(m.group(2)) / float(m.group(3)) == pytest.approx(int(m.group(1)) / 100, abs=0.011), (
                line
            )


def test_a_stalling_loader_reads_the_same_on_the_job_as_on_its_ranks(
    tmp_path: Path, subprocess_env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch")
    script = tmp_path / "stalling.py"
    script.write_text(STALLING)
    log = (tmp_path / "job.log").open("wb")
    env = child_env(None, subprocess_env)
    env["TORCHTOP_PHASE_EVERY"] = "64"  # about 1 step in 64 timed: the stall almost never is
    job = subprocess.Popen(
        [sys.executable, str(script), str(_free_port()), "240"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while sorted(a.rank or 0 for a in discovery.list_agents() if a.world_size == 2) != [0, 1]:
            assert time.monotonic() < deadline and job.poll() is None, (tmp_path / "job.log").read_text()
            time.sleep(0.3)
        time.sleep(5.0)  # past the first epoch
        stalled = 0
        for _ in range(2):  # a 15 s window holds a stall or two (the worker's start, its 3 s open)
            capsys.readouterr()
            assert cli.main(["report", "--seconds", "15"]) == 0, capsys.readouterr().err
            r = json.loads(capsys.readouterr().out)
            ranks = [e for e in r["ranks"] if e["steps"]]
            assert len(ranks) == 2, r["ranks"]
            share = r["job"]["breakdown"]["data"]
            own = [e["breakdown"]["data"] for e in ranks]
            assert all(abs(share - o) <= 0.10 for o in own), (share, own, r["verdict"])
            if r["verdict"]["kind"] == "data-loading":
                assert all(abs(r["verdict"]["share"] - o) <= 0.10 for o in own), (r["verdict"], own)
            _line_adds_up(r["verdict"])
            stalled += share >= 0.5
            if stalled:
                break  # a second report only where the first held no stall
        assert stalled, "no report held a stall"
    finally:
        if job.poll() is None:
            os.killpg(job.pid, 9)
        job.wait(30)
