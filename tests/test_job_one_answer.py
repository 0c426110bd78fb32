"""One job, one answer: a real torchrun DDP job (gloo, 2 ranks on CPU) whose ranks wait in
their all-reduce for most of the step reads `communication` in the live job report, in each
rank's entry and view, in the Prometheus `torchtop_verdict` series of both ranks, and in
`report` and `replay` of its recording (the job report and the job view, not rank 0 alone)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from torchtop.contract import discovery

pytestmark = [pytest.mark.slow]
# the job rules' verdicts: most of the step in all-reduce (a loaded machine may tip it to a rank)
JOB_KINDS = {"communication", "straggler"}

COMM_BOUND = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    layers = [torch.nn.Linear(1024, 1024) for _ in range(4)]  # 16 MB of gradients, a tiny batch
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(2, 1024)
    for _ in range(int(sys.argv[1])):  # a count: every rank runs the same iterations
        model(x).square().mean().backward(); opt.step(); opt.zero_grad()
    dist.destroy_process_group()
    """
)


def _cli(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torchtop.monitor.commands.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agree(job_kind: str, rank_kinds: list[str]) -> bool:
    """One job, one answer: each rank reads the job's verdict, except that the ranks a straggler
    holds read `waiting` (for it: issue 29), and only where the job has a straggler."""
    held = job_kind in ("straggler", "work-imbalance")
    return job_kind in JOB_KINDS and all(k == job_kind or (held and k == "waiting") for k in rank_kinds)


def _verdicts(port: int) -> dict[str, str]:
    """rank -> the verdict kind its torchtop_verdict series carries."""
    from prometheus_client.parser import text_string_to_metric_families  # pyright: ignore[reportMissingImports]  # optional

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name == "torchtop_verdict":
            out |= {s.labels["rank"]: s.labels["verdict"] for s in family.samples}
    return out


async def _replayed_views(rec: Path) -> tuple[str, list[str]]:
    from torchtop.contract.recording_reader import open_recording
    from torchtop.monitor.model.job_playback import JobPlayback
    from torchtop.monitor.tui.job_replay_app import JobReplayApp

    app = JobReplayApp(JobPlayback(open_recording(rec)))
    async with app.run_test(size=(120, 40)) as pilot:
        app.paused = True
        app.seek(app.played.end)
        await pilot.pause()
        assert app.job_diagnosis is not None and app.verdict_panel.diagnosis is not None
        job_kind = app.verdict_panel.diagnosis.verdict.kind
        ranks = []
        for _ in app.job.ranked():
            await pilot.press("right_square_bracket")  # the next rank's view
            await pilot.pause()
            ranks.append(app.verdict_panel.diagnosis.verdict.kind)
        return job_kind, ranks


@pytest.mark.export
async def test_a_ddp_job_reads_the_same_everywhere(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    pytest.importorskip("prometheus_client")
    script, rec = tmp_path / "comm.py", tmp_path / "rec"
    script.write_text(COMM_BOUND)
    run = [
        sys.executable,
        "-m",
        "torchtop.monitor.commands.cli",
        "run",
        "--no-tui",
        "--record",
        str(rec),
        "--",
    ]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    log = (tmp_path / "job.log").open("wb")
    job = subprocess.Popen(
        [*run, *torchrun, str(script), "700"],
        env=subprocess_env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    port = _free_port()
    exporter = None
    try:
        deadline = time.monotonic() + 120
        while len(discovery.list_agents()) < 2:
            assert time.monotonic() < deadline and job.poll() is None, (tmp_path / "job.log").read_text()[
                -3000:
            ]
            time.sleep(0.3)
        exporter = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torchtop.monitor.commands.cli",
                "export",
                "--prometheus",
                f"127.0.0.1:{port}",
            ],
            env=subprocess_env,
            stderr=subprocess.DEVNULL,
        )
        seen: dict[str, str] = {}
        while time.monotonic() < deadline and job.poll() is None:
            try:
                seen = _verdicts(port)
            except OSError:
                pass
            if seen.keys() == {"0", "1"} and set(seen.values()) <= JOB_KINDS | {"waiting"}:
                break
            time.sleep(1.0)
        # both ranks carry the job's verdict (each rank alone reads `compute`)
        named = set(seen.values()) - {"waiting"}
        assert seen.keys() == {"0", "1"} and len(named) == 1 and agree(min(named), list(seen.values())), seen
        live = _cli("report", "--seconds", "8", env=subprocess_env)
        assert live.returncode == 0, live.stderr
        report = json.loads(live.stdout)
        kind = report["verdict"]["kind"]
        assert kind in JOB_KINDS, report["verdict"]
        assert agree(kind, [e["verdict"]["kind"] for e in report["ranks"]]), report["ranks"]
        assert job.wait(240) == 0, (tmp_path / "job.log").read_text()[-3000:]
    finally:
        for p in (exporter, job):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL) if p is job else p.kill()
                p.wait(30)
        log.close()
    recorded = _cli("report", str(rec), "--seconds", "8", env=subprocess_env)
    assert recorded.returncode == 0, recorded.stderr
    report = json.loads(recorded.stdout)
    assert sorted(e["rank"] for e in report["ranks"]) == [0, 1]  # the job, not rank 0 alone
    kind = report["verdict"]["kind"]
    assert kind in JOB_KINDS, report["verdict"]
    assert agree(kind, [e["verdict"]["kind"] for e in report["ranks"]]), report["ranks"]
    one = _cli("report", str(rec), "--rank", "1", "--seconds", "8", env=subprocess_env)
    assert one.returncode == 0 and agree(kind, [json.loads(one.stdout)["verdict"]["kind"]])
    job_kind, rank_kinds = await _replayed_views(rec)
    assert agree(job_kind, rank_kinds), (job_kind, rank_kinds)
