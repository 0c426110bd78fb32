"""The discovery file as a contract struct (issue 27): `AgentInfo` reads older agents' files and
newer ones' (unknown fields ignored), writes today's keys, and keeps an entry with a wrongly typed
field listed, so the monitor names it in one line instead of crashing or hiding it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchtop.contract import discovery
from torchtop.contract.discovery import AgentInfo
from torchtop.monitor.link.targets import TargetError, from_discovery, parse

KEYS = [
    "pid", "host", "transport", "address", "pub_address", "bind", "port", "pub_port", "rank",
    "world_size", "local_rank", "local_world_size", "node_rank", "job_id", "launcher", "argv",
    "start_time", "run_id", "version", "server_key", "client_key", "client_secret", "proc_start",
]  # fmt: skip


def _file(runtime_dir: Path, doc: object, pid: int | None = None) -> Path:
    path = runtime_dir / f"agent-{pid or os.getpid()}.json"
    path.write_text(json.dumps(doc))
    path.chmod(0o600)
    return path


def test_write_keeps_the_file_keys_and_list_reads_them_back(runtime_dir: Path) -> None:
    me = os.getpid()
    info = AgentInfo(pid=me, transport="ipc", address="ipc:///a.req", pub_address="ipc:///a.pub")
    info.start_time, info.argv, info.file, info.unusable, info.ssh = time.time(), ["x.py"], "f", None, "s"
    path = discovery.write(info)
    on_disk = json.loads(path.read_text())
    assert list(on_disk) == KEYS  # the reader-side fields are never written
    assert on_disk["address"] == "ipc:///a.req" and on_disk["port"] is None and on_disk["argv"] == ["x.py"]
    (listed,) = discovery.list_agents()
    assert listed.file == str(path) and listed.ssh is None and listed.unusable is None
    assert discovery.listing(listed) == on_disk | {"file": str(path)}  # what `ls --json` prints


def test_an_older_and_a_newer_agents_files_read(runtime_dir: Path) -> None:
    me = os.getpid()
    _file(runtime_dir, {"pid": me, "port": 40000, "start_time": time.time(), "future": {"x": 1}})
    (info,) = discovery.list_agents()
    assert (info.pid, info.port, info.address, info.rank, info.unusable) == (me, 40000, None, None, None)
    assert from_discovery(info).address == "tcp://127.0.0.1:40000"


def test_a_wrongly_typed_field_is_listed_and_refused_in_one_line(runtime_dir: Path) -> None:
    me = os.getpid()
    doc = {"pid": me, "address": 5, "pub_address": "ipc:///a.pub", "rank": 2, "start_time": time.time()}
    _file(runtime_dir, doc)
    (info,) = discovery.list_agents()
    assert info.pid == me and info.rank == 2 and info.address is None  # what validates is kept
    assert info.unusable and "address" in info.unusable
    with pytest.raises(TargetError, match=f"^the discovery entry of pid {me} is unusable .*address"):
        from_discovery(info)
    with pytest.raises(TargetError, match=f"the discovery entry of pid {me} is unusable"):
        parse(str(me))
    assert "unusable" in discovery.listing(info)


@pytest.mark.parametrize("doc", [[1, 2], "text", {"pid": "12"}, {"pid": True, "port": 1}, {"port": 1}])
def test_files_that_are_not_objects_or_name_no_int_pid_are_skipped(runtime_dir: Path, doc: object) -> None:
    path = _file(runtime_dir, doc)
    agents, skipped = discovery.scan()
    assert agents == [] and [s.file for s in skipped] == [str(path)]
    assert path.exists()  # not provably a stale entry of ours (issue 37): said, never removed


def test_a_stale_entry_of_ours_is_removed_and_one_named_otherwise_is_not(runtime_dir: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    ours = _file(runtime_dir, {"pid": dead.pid}, pid=dead.pid)
    other = runtime_dir / "agent-other.json"
    other.write_text(json.dumps({"pid": dead.pid}))
    assert discovery.scan() == ([], [])
    assert not ours.exists() and other.exists()


def test_a_listing_never_names_the_ssh_target() -> None:
    info = discovery.entry({"pid": 3, "address": "ipc:///a.req", "ssh": "ssh://elsewhere"})
    assert info.ssh is None and info.unusable is None
