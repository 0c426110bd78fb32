"""The job view does not take discovery files on trust (issue 26, item 7): two agents claiming one
rank are noted in the job state and the report; a stale file of the older format whose pid was
reused is not listed as live; a job report with no live rank is an error."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from torchtop.contract import discovery, wire
from torchtop.monitor.commands.cli import main
from torchtop.monitor.diagnosis.job_diagnosis import build_job_report
from torchtop.monitor.model.job_state import JobState

V = wire.PROTOCOL_VERSION


def _hello(rank: int, pid: int, host: str = "node1", job: str = "J") -> wire.Hello:
    return wire.Hello(
        v=V, run_id=f"run{pid}", pid=pid, host=host, port=0, pub_port=0, device="cpu",
        start_time=1.0, rank=rank, world_size=2, job_id=job,
    )  # fmt: skip


def test_two_agents_claiming_one_rank_are_noted_in_the_job_and_its_report() -> None:
    job = JobState("J")
    assert job.apply_hello("pid 10", _hello(0, 10))
    assert job.apply_hello("pid 11", _hello(1, 11))
    assert job.notes == []
    job.apply_hello("pid 66", _hello(0, 66, "node2"))  # a same-user file claiming rank 0
    (note,) = job.notes
    assert "two agents claim rank 0" in note and "pid 10 on node1" in note and "pid 66 on node2" in note
    report = build_job_report(job, 1.0)
    assert note in report["notes"]


def test_a_file_pointing_at_another_ranks_agent_is_noted() -> None:
    job = JobState("J")
    job.apply_hello("pid 10 (ipc)", _hello(0, 10))
    job.apply_hello("pid 99 (ipc)", _hello(0, 10))  # a second file, the same agent behind it
    assert any("reach the same agent (pid 10" in n for n in job.notes)


@pytest.fixture
def younger_process():  # type: ignore[no-untyped-def]
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    time.sleep(0.2)
    yield proc
    proc.kill()
    proc.wait()


def _write_old_format(runtime_dir: Path, pid: int, **extra: object) -> Path:
    """A discovery file as an older agent wrote it: no proc_start."""
    path = runtime_dir / f"agent-{pid}.json"
    info = {
        "pid": pid,
        "transport": "ipc",
        "address": "ipc:///nowhere.req",
        "pub_address": "ipc:///nowhere.pub",
    }
    path.write_text(json.dumps(info | extra))
    path.chmod(0o600)
    return path


def test_an_old_format_file_with_a_reused_pid_is_not_live(runtime_dir: Path, younger_process) -> None:  # type: ignore[no-untyped-def]
    pid = younger_process.pid
    old = time.time() - 3600
    path = _write_old_format(runtime_dir, pid, start_time=old)  # the agent started an hour ago ...
    assert discovery.list_agents() == []  # ... in a process that began a moment ago: another one
    assert not path.exists()  # cleaned
    path = _write_old_format(runtime_dir, pid)  # no start time either: the file's own age says it
    os.utime(path, (old, old))
    assert discovery.list_agents() == []
    path = _write_old_format(runtime_dir, pid, start_time=time.time())  # a live older agent: listed
    assert [a.pid for a in discovery.list_agents()] == [pid]


@pytest.mark.slow  # it waits out the report's connect time (job.CONNECT_S) for the hellos
def test_a_job_report_with_no_live_rank_is_an_error(runtime_dir: Path) -> None:
    for rank in (0, 1):  # two files of a job naming this (live) process, nobody listening
        _write_old_format(
            runtime_dir, os.getpid() if rank == 0 else os.getppid(), start_time=time.time(),
            job_id="J", rank=rank, world_size=2,
        )  # fmt: skip
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(["report", "--job", "J", "--seconds", "0.5"])
    assert code == 2 and out.getvalue() == ""
    assert err.getvalue().count("\n") == 1 and "no rank of job J answered" in err.getvalue()
