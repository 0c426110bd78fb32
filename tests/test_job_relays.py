"""A real 16-rank CPU job (gloo DDP, `torchrun --nnodes 2 --nproc_per_node 8`) on two simulated
nodes, each reached through a real sshd on loopback under its own host alias (node1, node2: each
alias tells the remote torchtop which runtime directory is that node's). Each node's local rank 0
starts its relay; the relays register in the job's own rendezvous store (node 0's torchrun
TCPStore). `torchtop report --store` finds both nodes there and sees one job through two relays,
with coverage and the straggler named; the job view shows the same; the export carries per-rank
series and the job's verdict. Heavy on a 2-core machine: a tiny model, marked slow."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from remote_util import loopback_sshd

from tests.agent_util import free_port
from tests.tui_util import wait_for
from torchtop.monitor.link import ssh
from torchtop.monitor.link.job_targets import open_job
from torchtop.monitor.relay.registry import list_relays
from torchtop.monitor.tui.job_app import JobApp

pytestmark = pytest.mark.slow
SLOW_RANK = 11  # on node 2

TRAIN = r"""
import os, sys, time, torch, torch.distributed as dist
import torchtop.agent

torch.set_num_threads(1)
torchtop.agent.start()
dist.init_process_group("gloo")
slow = dist.get_rank() == int(os.environ["SLOW_RANK"])


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 4)

    def forward(self, x):
        if slow:
            time.sleep(0.06)  # this rank's own time: the others wait for it in the all-reduce
        return self.lin(x)


model = torch.nn.parallel.DistributedDataParallel(Net())
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x, y = torch.randn(8, 16), torch.randn(8, 4)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
"""


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    d = tmp_path_factory.mktemp("relaynodes")
    aliases = (
        "Host node1 node2\n  HostName 127.0.0.1\n"
        "Host node1\n  SetEnv TORCHTOP_NODE=node1\nHost node2\n  SetEnv TORCHTOP_NODE=node2\n"
    )
    with loopback_sshd(
        d, sshd_extra="AcceptEnv TORCHTOP_NODE\nMaxStartups 100\n", client_extra=aliases
    ) as found:
        if isinstance(found, str):
            pytest.skip(found)
        config = d / "ssh_config"  # the aliases' port: `ssh node1` as a cluster's config would have it
        config.write_text(f"Host node1 node2\n  Port {found['port']}\n" + config.read_text())
        base = d / "rt"
        for n in ("node1", "node2"):
            (base / n).mkdir(parents=True, mode=0o700)
        remote = (
            f'env TORCHTOP_RUNTIME_DIR={shlex.quote(str(base))}/"$TORCHTOP_NODE" '
            f"{shlex.quote(sys.executable)} -m torchtop.monitor.commands.cli"
        )
        yield {**found, "base": base, "remote": remote}


@pytest.fixture(scope="module")
def job(sshd: dict, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """Two torchruns of 8 ranks each, one per simulated node; yields once both relays summarize
    16 stepping ranks."""
    d = tmp_path_factory.mktemp("relayjob")
    (d / "train.py").write_text(TRAIN)
    port = free_port()
    procs = []
    env0 = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    try:
        for node in (0, 1):
            env = {
                **env0,
                "TORCHTOP_RUNTIME_DIR": str(sshd["base"] / f"node{node + 1}"),
                "TORCHTOP_NODE": f"node{node + 1}",
                "TORCHTOP_QUIET": "1",
                "SLOW_RANK": str(SLOW_RANK),
                "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1",
            }
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
                "--nproc_per_node", "8", "--master_addr", "127.0.0.1", "--master_port", str(port),
                str(d / "train.py"), "900",
            ]  # fmt: skip
            log = (d / f"node{node}.log").open("wb")
            procs.append(
                subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            )
        yield {"port": port, "dir": d, "procs": procs}
    finally:
        import psutil

        workers = []
        for p in procs:  # torchrun stops its workers on SIGTERM; any left are killed by pid
            try:
                workers += psutil.Process(p.pid).children(recursive=True)
            except psutil.Error:
                pass
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for w in workers:
            try:
                w.kill()
            except psutil.Error:
                pass


def _env(sshd: dict) -> dict[str, str]:
    return {**os.environ, ssh.ENV_OPTS: sshd["opts"], ssh.ENV_REMOTE_CMD: sshd["remote"]}


def _report(sshd: dict, job: dict, *args: str, env: dict[str, str] | None = None) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "torchtop.monitor.commands.cli", "report", *args, "--seconds", "6"],
        env={**_env(sshd), **(env or {})}, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr + " | " + (job["dir"] / "node0.log").read_text()[-1500:]
    return json.loads(proc.stdout)


def _wait_relays(sshd: dict, job: dict) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        ok = 0
        for n in ("node1", "node2"):
            os.environ["TORCHTOP_RUNTIME_DIR"] = str(sshd["base"] / n)
            ok += len(list_relays()) == 1
        if ok == 2:
            return
        assert all(p.poll() is None for p in job["procs"]), (job["dir"] / "node0.log").read_text()[-2000:]
        time.sleep(1)
    raise AssertionError("no relay on each node: " + (job["dir"] / "node1.log").read_text()[-2000:])


def test_a_16_rank_job_through_two_relays_found_in_its_store(
    sshd: dict, job: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHTOP_RUNTIME_DIR", os.environ["TORCHTOP_RUNTIME_DIR"])  # restored after
    _wait_relays(sshd, job)
    deadline = time.monotonic() + 240
    while True:  # the ranks take a while to start stepping on 2 shared cores
        report = _report(sshd, job, "--store", f"127.0.0.1:{job['port']}")
        stepping = [e for e in report["ranks"] if e["steps"] > 0]
        # (a rank starved of CPU for 3 s as a report ends is not reporting in it: the next one)
        everyone = report["coverage"]["line"] == "16 of 16 ranks reporting"
        if (len(stepping) == 16 and report["straggler"] and everyone) or time.monotonic() > deadline:
            break
    assert report["coverage"]["relays"] == ["node1", "node2"], report["coverage"]
    assert report["coverage"]["line"] == "16 of 16 ranks reporting", report["coverage"]
    assert [e["rank"] for e in report["ranks"]] == list(range(16))
    assert {e["via"] for e in report["ranks"]} == {"relay"}
    assert {e["node"] for e in report["ranks"] if e["rank"] >= 8} == {"node2"}
    assert report["straggler"]["rank"] == SLOW_RANK, report["straggler"]
    assert report["verdict"]["kind"] == "straggler"
    # one job, one answer by path: the same job read rank by rank over ssh, no relay between
    while True:
        direct = _report(sshd, job, "ssh://node1", "ssh://node2", env={"TORCHTOP_RELAYS": "0"})
        if (direct["straggler"] and len(direct["ranks"]) == 16) or time.monotonic() > deadline + 120:
            break
    assert "relay" not in {e.get("via") for e in direct["ranks"]} and len(direct["ranks"]) == 16, direct[
        "ranks"
    ]
    assert direct["verdict"]["kind"] == report["verdict"]["kind"], (direct["verdict"], report["verdict"])
    assert direct["straggler"]["rank"] == SLOW_RANK, direct["straggler"]


async def test_the_job_view_through_two_relays_names_the_straggler(
    sshd: dict, job: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ssh.ENV_OPTS, sshd["opts"])
    monkeypatch.setenv(ssh.ENV_REMOTE_CMD, sshd["remote"])
    monkeypatch.setenv("TORCHTOP_RUNTIME_DIR", os.environ["TORCHTOP_RUNTIME_DIR"])
    _wait_relays(sshd, job)
    with open_job(["ssh://node1", "ssh://node2"]) as plan:
        assert len(plan.relays) == 2 and plan.endpoints == [], plan
        app = JobApp(plan)
        async with app.run_test(size=(120, 40)) as pilot:

            def named() -> bool:  # (a rank starved of CPU for 3 s on the loaded machine is not reporting)
                app.refresh_panels()
                named = app.straggler is not None and app.straggler.rank == SLOW_RANK
                return named and "16 of 16 ranks reporting" in app.ranks_panel.plain()

            assert await wait_for(pilot, named, 120), app.ranks_panel.plain().splitlines()[:8]
            text = app.ranks_panel.plain()
            assert f"● rank {SLOW_RANK}: forward" in text


@pytest.mark.export
def test_the_export_carries_every_ranks_series_and_the_jobs_verdict(sshd: dict, job: dict) -> None:
    import urllib.request

    _wait_relays(sshd, job)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchtop.monitor.commands.cli", "export", "--store", f"127.0.0.1:{job['port']}",
         "--prometheus", f"127.0.0.1:{port}", "--job", "llm", "--seconds", "180"],
        env=_env(sshd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline, text = time.monotonic() + 150, ""
        while time.monotonic() < deadline:
            time.sleep(2)
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            except OSError:
                continue
            lines = [ln for ln in text.splitlines() if ln.startswith("torchtop_rank_own_seconds{")]
            if len(lines) == 16 and f'torchtop_job_straggler_rank{{job="llm"}} {SLOW_RANK}.0' in text:
                break
        assert len([ln for ln in text.splitlines() if ln.startswith("torchtop_rank_own_seconds{")]) == 16, (
            text[-3000:]
        )
        assert 'node="node2",rank="11"' in text
        assert f'torchtop_job_straggler_rank{{job="llm"}} {SLOW_RANK}.0' in text, text[-3000:]
        assert 'torchtop_job_ranks_expected{job="llm"} 16.0' in text
    finally:
        import psutil

        try:
            tunnels = psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            tunnels = []
        proc.terminate()  # as a service manager stops it: its ssh tunnels close with it
        proc.wait(20)
        gone, alive = psutil.wait_procs(tunnels, timeout=10)
        for p in alive:
            p.kill()
        assert tunnels and not alive, f"ssh tunnels left behind: {alive}"


def test_report_with_no_argument_on_a_node_finds_the_other_node_in_the_store(sshd: dict, job: dict) -> None:
    _wait_relays(sshd, job)
    env = {**_env(sshd), "TORCHTOP_RUNTIME_DIR": str(sshd["base"] / "node1"), "TORCHTOP_NODE": "node1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torchtop.monitor.commands.cli", "report", "--seconds", "4"],
        env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["coverage"]["relays"] == ["node1", "node2"], report["coverage"]
    assert len(report["ranks"]) == 16 and report["coverage"]["expected"] == 16
