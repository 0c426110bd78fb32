"""Two nodes, simulated: the 4 ranks of one job on this machine, 2 registered per "node", each
node reached as its own SSH target through a real sshd on loopback (node1 and node2 are host
aliases that tell the remote torchtop which runtime directory is that node's). One job report and
one job view over both; a third node whose ssh fails is named in one line while the rest shows;
a rank killed mid-run shows as gone while the others go on."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from remote_util import TRAIN, loopback_sshd

from tests.agent_util import free_port
from tests.tui_util import wait_for
from torchtop.contract import discovery
from torchtop.monitor.link import ssh
from torchtop.monitor.link.client import AgentClient, AgentUnreachable
from torchtop.monitor.link.job_targets import open_job
from torchtop.monitor.link.targets import from_discovery
from torchtop.monitor.tui.job_app import JobApp

pytestmark = pytest.mark.slow
JOB_ENV = {
    "TORCHELASTIC_RUN_ID": "twonode",
    "MASTER_ADDR": "node1",
    "MASTER_PORT": "29999",
    "WORLD_SIZE": "4",
    "TORCHTOP_RELAY": "0",  # nodes without a relay (an older torchtop): each rank reached on its own
}


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    d = tmp_path_factory.mktemp("nodes")
    aliases = (
        "Host node1 node2 deadnode\n  HostName 127.0.0.1\n"
        "Host node1\n  SetEnv TORCHTOP_NODE=node1\nHost node2\n  SetEnv TORCHTOP_NODE=node2\n"
    )
    with loopback_sshd(d, sshd_extra="AcceptEnv TORCHTOP_NODE\n", client_extra=aliases) as found:
        if isinstance(found, str):
            pytest.skip(found)
        base = d / "rt"
        for n in ("node1", "node2"):
            (base / n).mkdir(parents=True, mode=0o700)
        # the remote shell picks the node's runtime directory from the variable its alias sent
        remote = (
            f'env TORCHTOP_RUNTIME_DIR={shlex.quote(str(base))}/"$TORCHTOP_NODE" '
            f"{shlex.quote(sys.executable)} -m torchtop.monitor.commands.cli"
        )
        yield {**found, "base": base, "remote": remote}


@pytest.fixture
def ranks(nodes: dict, tmp_path: Path, subprocess_env: dict[str, str], monkeypatch: pytest.MonkeyPatch):
    """Ranks 0-1 on node1, 2-3 on node2 (one job id); yields {rank: process}, once each of these
    processes has registered and steps (an earlier test's killed ranks leave their discovery
    files in the node directories: those are not waited on)."""
    monkeypatch.setenv(ssh.ENV_OPTS, nodes["opts"])
    monkeypatch.setenv(ssh.ENV_REMOTE_CMD, nodes["remote"])
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    procs: dict[int, subprocess.Popen] = {}
    logs = {r: tmp_path / f"rank{r}.log" for r in range(4)}
    try:
        for r in range(4):
            node = nodes["base"] / f"node{1 + r // 2}"
            env = {
                **subprocess_env,
                **JOB_ENV,
                "RANK": str(r),
                "LOCAL_RANK": str(r % 2),
                "TORCHTOP_RUNTIME_DIR": str(node),
            }
            with logs[r].open("wb") as log:  # the child keeps its own descriptor
                procs[r] = subprocess.Popen(
                    [sys.executable, str(script), "600"], env=env, cwd=tmp_path,  # outlives the test: killed below
                    stdout=log, stderr=subprocess.STDOUT,
                )  # fmt: skip
        files = {r: nodes["base"] / f"node{1 + r // 2}" / f"agent-{p.pid}.json" for r, p in procs.items()}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all(f.exists() for f in files.values()):
            if any(p.poll() is not None for p in procs.values()):
                break
            time.sleep(0.2)
        missing = [r for r, f in files.items() if not f.exists()]
        assert not missing, f"ranks {missing} did not register: " + " | ".join(
            f"rank {r} (exit {procs[r].poll()}): {logs[r].read_text()[-500:]}" for r in missing
        )
        for r, path in files.items():  # every rank is stepping
            client = AgentClient(from_discovery(discovery.entry(json.loads(path.read_text()))))
            try:
                while time.monotonic() < deadline and len(_steps(client)) < 20:
                    time.sleep(0.2)
            finally:
                client.close()
            assert procs[r].poll() is None, f"rank {r} exited: {logs[r].read_text()[-500:]}"
        yield procs
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait()


def _steps(client: AgentClient) -> list:
    try:
        return client.snapshot(timeout=10.0).steps
    except AgentUnreachable:  # a loaded machine: ask again
        return []


def _targets(nodes: dict) -> list[str]:
    port = nodes["port"]
    return [f"ssh://node1:{port}", f"ssh://node2:{port}"]


def test_one_report_over_two_nodes_and_a_dead_one(
    nodes: dict, ranks: dict, subprocess_env: dict[str, str]
) -> None:
    env = {**subprocess_env, ssh.ENV_OPTS: nodes["opts"], ssh.ENV_REMOTE_CMD: nodes["remote"]}
    dead = f"ssh://deadnode:{free_port()}"
    proc = subprocess.run(
        [sys.executable, "-m", "torchtop.monitor.commands.cli", "report", *_targets(nodes), dead, "--seconds", "3"],
        env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert [e["rank"] for e in report["ranks"]] == [0, 1, 2, 3]
    assert report["job_id"] == "twonode@node1:29999"
    assert all(e["steps"] > 0 and e["status"] == "connected" for e in report["ranks"]), [
        (e["steps"], e["status"]) for e in report["ranks"]
    ]
    assert {e["target"].split("/")[2].split(":")[0] for e in report["ranks"]} == {"node1", "node2"}
    (note,) = [n for n in report["notes"] if "deadnode" in n]  # one line, naming the node
    assert "ssh to deadnode failed" in note and "\n" not in note


async def test_one_job_view_over_two_nodes_and_a_rank_that_dies(nodes: dict, ranks: dict) -> None:
    with open_job(_targets(nodes)) as plan:
        assert len(plan.endpoints) == 4 and plan.job_id == "twonode@node1:29999"
        app = JobApp(plan)
        async with app.run_test(size=(120, 40)) as pilot:

            def connected() -> int:
                now = app.clock()
                return sum(
                    m.state.connection(now) == "connected" and bool(m.state.steps) for m in app.job.ranked()
                )

            assert await wait_for(pilot, lambda: connected() == 4, 60), app.status_line.plain()
            app.refresh_panels()
            assert [r.rank for r in app.ranks_panel.view.rows] == [0, 1, 2, 3]
            ranks[3].send_signal(signal.SIGKILL)  # a rank dies mid-run
            assert await wait_for(pilot, lambda: "gone: rank 3" in app.status_line.plain(), 60), (
                app.status_line.plain()
            )

            def latest() -> dict[int, int]:  # each rank's latest step
                return {m.rank: m.state.steps[-1].i for m in app.job.ranked()}

            # the others go on: new steps from each, waited for (a fixed pause was a guess at how
            # soon a loaded machine's ranks and tunnels bring them)
            before = latest()
            went_on = lambda: all(latest()[r] > before[r] for r in (0, 1, 2))  # noqa: E731
            assert await wait_for(pilot, went_on, 60), (before, latest())
            app.refresh_panels()
            assert "agent gone" in app.ranks_panel.plain()
    assert os.environ.get(ssh.ENV_OPTS)  # (the fixture's ssh options were in force)
