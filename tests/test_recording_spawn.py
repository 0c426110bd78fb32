"""Recording a process whose rank no launcher named (mp.spawn sets no RANK; issue 39): the recorder
holds its batches until the rank settles, then writes them first into that rank's directory, under
a Hello of that rank; a process that never settles (the launcher) records nothing. End to end: an
mp.spawn job under `torchtop run --record` reads back as a job of both ranks, each traced with its
own pid."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from collections import deque
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from tests.recording_util import batch, hello
from torchtop.agent.loop.recorder import Recorder
from torchtop.contract import wire
from torchtop.contract.recording_reader import read_rank
from torchtop.monitor.commands.cli import main
from torchtop.monitor.commands.run import child_env


def test_held_batches_go_first_into_the_settled_ranks_directory(tmp_path: Path) -> None:
    rec = Recorder(tmp_path, None)
    rec.start()
    rec.put(hello(rank=0))  # built before the rank was known: replaced by the settled one
    for k in range(3):
        rec.put(batch(k, rank=0))
    rec.settle(1, hello(rank=1))
    rec.put(batch(3, rank=1))
    rec.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank1"]
    got = read_rank(tmp_path / "rank1")
    assert got.warnings == []
    msgs = list(got.messages)
    assert isinstance(msgs[0], wire.Hello) and msgs[0].rank == 1
    assert [m.seq for m in msgs if isinstance(m, wire.Batch)] == [0, 1, 2, 3]
    assert {m.rank for m in msgs} == {1}


def test_a_recorder_never_settled_writes_nothing(tmp_path: Path) -> None:
    """The mp.spawn launcher: it never trains, so it is no rank and leaves no directory."""
    rec = Recorder(tmp_path / "job", None)
    rec.start()
    for k in range(3):
        rec.put(batch(k))
    rec.close()
    assert not (tmp_path / "job").exists()


def test_held_batches_are_bounded_the_oldest_dropped_and_counted(tmp_path: Path) -> None:
    rec = Recorder(tmp_path, None)
    rec.held = deque(maxlen=4)  # HELD_ITEMS, smaller
    rec.start()
    for k in range(10):
        rec.put(batch(k))
    rec.settle(0, hello())
    rec.close()
    got = [m.seq for m in read_rank(tmp_path / "rank0").messages if isinstance(m, wire.Batch)]
    assert got == [6, 7, 8, 9] and rec.held_dropped == 6


SPAWNING = textwrap.dedent(
    """
    import os, sys, torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    def main_worker(rank, world, port, steps):
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        sys.stdout.write(f"rank {rank} pid {os.getpid()}\\n")  # one write: the two ranks share the pipe
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(8, 16)
        for _ in range(steps):  # a count: DDP ranks run the same iterations
            model(x).sum().backward(); opt.step(); opt.zero_grad()
        dist.barrier()
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(main_worker, args=(2, int(sys.argv[1]), int(sys.argv[2])), nprocs=2)
    """
)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_an_mp_spawn_job_records_as_a_job_of_both_ranks(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    script, record = tmp_path / "spawning.py", tmp_path / "run"
    script.write_text(SPAWNING)
    env = child_env(None, subprocess_env, record=str(record))  # what `torchtop run --record` gives
    job = subprocess.run(
        [sys.executable, str(script), str(_free_port()), "400"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert job.returncode == 0, job.stdout + job.stderr
    pids = {
        int(w[1]): int(w[3]) for w in (line.split() for line in job.stdout.splitlines()) if w[:1] == ["rank"]
    }
    assert sorted(pids) == [0, 1], job.stdout[-2000:] + job.stderr[-2000:]
    assert sorted(p.name for p in record.iterdir()) == ["rank0", "rank1"]  # the launcher left none
    for r, pid in pids.items():
        got = read_rank(record / f"rank{r}")
        assert not any("runs" in w for w in got.warnings), got.warnings
        assert got.hello is not None and (got.hello.rank, got.hello.pid, got.hello.world_size) == (r, pid, 2)
        assert {m.rank for m in got.messages} == {r}
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["report", str(record)]) == 0
    report = json.loads(out.getvalue())
    assert sorted(e["rank"] for e in report["ranks"]) == [0, 1], report
    trace = tmp_path / "t.json"
    assert main(["trace", str(record), "-o", str(trace)]) == 0
    names = [
        e["args"]["name"]
        for e in json.loads(trace.read_text())["traceEvents"]
        if e.get("ph") == "M" and e.get("name") == "process_name"
    ]
    for r, pid in pids.items():
        assert any(n.startswith(f"rank {r} ") and f"pid {pid} " in n for n in names), names
    assert os.getpid() not in pids.values()


PLAIN = textwrap.dedent(
    """
    import torch

    torch.set_num_threads(1)
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 16)
    for _ in range(300):
        model(x).sum().backward(); opt.step(); opt.zero_grad()
    """
)


@pytest.mark.slow
def test_a_process_on_its_own_still_records_as_rank_0(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    script, record = tmp_path / "plain.py", tmp_path / "run"
    script.write_text(PLAIN)
    env = child_env(None, subprocess_env, record=str(record))
    job = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stdout + job.stderr
    assert [p.name for p in record.iterdir()] == ["rank0"]
    got = read_rank(record / "rank0")
    assert got.warnings == [] and got.hello is not None and got.hello.rank == 0
    assert got.step_counts[-1] == 300
