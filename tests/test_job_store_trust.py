"""A real 2-node job (one rank a node, two runtime directories and node names on one machine),
each node's relay on TCP with CURVE and registered in the job's own rendezvous store (a torch
TCPStore on loopback). Another user who reaches the store's port appends a relay line for node B
(its own CURVE key and address: the newest line) and junk: `torchtop report --store`, with this
monitor's keys set up and node B's server key in its keys directory, never connects to the forged
address, reads both real relays, and says what it set aside. No ssh: the relays are reached
directly, with the key the user holds."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from remote_util import TRAIN

from tests.benchmarks.bench_job_monitor import free_pairs
from torchtop.contract import curve_keys
from torchtop.monitor.link import store

pytestmark = pytest.mark.slow

FORGE = r"""
import json, sys
from torchtop.monitor.link.store import StoreClient, relays_key
host, port, job, line = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
with StoreClient(host, port) as store:  # anyone who reaches the master port may write the store
    for junk in (line, "not json", json.dumps({"node": "nodeA", "job_id": job, "pid": 2**70})):
        store.append(relays_key(job), (junk + "\n").encode())
    store.check(relays_key(job))
"""


@pytest.fixture
def master() -> Iterator[tuple[str, int]]:
    import torch.distributed as dist

    s = dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]  (torch's stubs: it is public)
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10)
    )
    yield "127.0.0.1", s.port
    del s


def _keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path, str]:
    """(the relays' config dir, this monitor's, a stranger's public key): the relays' server pair
    authorizes this monitor's client key; the monitor holds the relays' server.key."""
    from torchtop.monitor.commands import keys as keys_cli

    relays, monitor, stranger = tmp_path / "relays", tmp_path / "monitor", tmp_path / "stranger"
    monkeypatch.setenv(curve_keys.ENV_CONFIG, str(stranger))
    forged = curve_keys.read_cert(keys_cli.make_pair("server")[0])[0].decode()
    monkeypatch.setenv(curve_keys.ENV_CONFIG, str(monitor))
    client_public = keys_cli.make_pair("client")[0]
    monkeypatch.setenv(curve_keys.ENV_CONFIG, str(relays))
    keys_cli.make_pair("server")
    keys_cli.authorize(str(client_public), "monitor")
    known = monitor / "keys" / curve_keys.KNOWN_SERVERS
    known.mkdir()
    shutil.copy(relays / "keys" / "server.key", known / "nodes.key")  # the user's own copy
    monkeypatch.delenv(curve_keys.ENV_CONFIG)
    return relays, monitor, forged


def test_a_forged_relay_line_in_the_jobs_store_is_not_used(
    tmp_path: Path, subprocess_env: dict[str, str], master: tuple[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    relays_cfg, monitor_cfg, forged_key = _keys(tmp_path, monkeypatch)
    (tmp_path / "train.py").write_text(TRAIN)
    ports = free_pairs(2)
    procs = []
    try:
        for rank, node in enumerate(("nodeA", "nodeB")):
            rt = tmp_path / f"rt-{node}"
            rt.mkdir(mode=0o700)
            env = {
                **subprocess_env, "TORCHTOP_RUNTIME_DIR": str(rt), "TORCHTOP_NODE": node,
                curve_keys.ENV_CONFIG: str(relays_cfg), "TORCHTOP_RELAY_PORT": str(ports[rank]),
                "TORCHTOP_RELAY_BIND": "127.0.0.1", "TORCHELASTIC_RUN_ID": "trust",
                "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]), "WORLD_SIZE": "2",
                "RANK": str(rank), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            }  # fmt: skip
            log = (tmp_path / f"{node}.log").open("wb")
            cmd = [sys.executable, str(tmp_path / "train.py"), "300"]
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        job_id = f"trust@127.0.0.1:{master[1]}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            entries = store.read_relays(*master, job_id).entries
            if {e.node for e in entries if e.tcp_address} == {"nodeA", "nodeB"}:
                break
            time.sleep(1)
        else:
            raise AssertionError((tmp_path / "nodeB.log").read_text()[-2000:])
        trap = socket.socket()
        trap.bind(("127.0.0.1", 0))
        trap.listen()
        trap.settimeout(0.2)
        tport = trap.getsockname()[1]
        line = json.dumps({
            "kind": "relay", "pid": 4242, "job_id": job_id, "node": "nodeB", "host": "127.0.0.1",
            "ssh_host": "127.0.0.1", "address": "ipc:///tmp/forged.req", "pub_address": "ipc:///tmp/forged.pub",
            "tcp_address": f"tcp://127.0.0.1:{tport}", "tcp_pub_address": f"tcp://127.0.0.1:{tport + 1}",
            "server_key": forged_key,
        })  # fmt: skip
        setpriv = shutil.which("setpriv")
        other = (
            [setpriv, "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
            if setpriv and os.geteuid() == 0
            else []
        )
        forge = subprocess.run(
            [*other, sys.executable, "-c", FORGE, *map(str, master), job_id, line],
            capture_output=True, text=True, timeout=60, cwd="/",
        )  # fmt: skip
        assert forge.returncode == 0, forge.stderr
        env = {
            **subprocess_env,
            curve_keys.ENV_CONFIG: str(monitor_cfg),
            "TORCHTOP_RUNTIME_DIR": str(tmp_path),
        }
        cmd = [
            sys.executable,
            "-m",
            "torchtop.monitor.commands.cli",
            "report",
            "--store",
            f"{master[0]}:{master[1]}",
        ]
        report: dict = {}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the ranks take a while to step on a loaded machine
            proc = subprocess.run(
                [*cmd, "--seconds", "4"], env=env, capture_output=True, text=True, timeout=120
            )
            assert proc.returncode == 0, proc.stderr
            report = json.loads(proc.stdout)
            if report["coverage"]["line"] == "2 of 2 ranks reporting":
                break
        with pytest.raises(TimeoutError):
            trap.accept()  # nothing came to the forged relay's address
        trap.close()
        assert report["coverage"]["line"] == "2 of 2 ranks reporting", report["coverage"]
        assert report["coverage"]["relays"] == ["nodeA", "nodeB"], report["coverage"]
        assert {e["node"]: e["rank"] for e in report["ranks"]} == {"nodeA": 0, "nodeB": 1}, report["ranks"]
        notes = report["notes"]
        assert "nodeB: 2 relay registrations; using the one whose key is known" in notes, notes
        assert any("2 lines of job" in n and "not a relay's entry" in n for n in notes), notes
    finally:
        for p in procs:
            p.kill()
            p.wait()
