"""Nothing a job's store or a runtime directory holds is taken on its word (issue 37): a relay's
CURVE key is used only when the user's own keys directory holds it, every registration of a node
is kept and a conflict said, hostile lines drop no node, the hosts a store can send the monitor
to are capped and the rest named, and a hostile relay file is listed with its reason, never
raised on."""

from __future__ import annotations

import datetime
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from torchtop.contract import curve_keys
from torchtop.contract.relay import RelayInfo, relay_info, relay_line
from torchtop.monitor.link.relay_targets import DIRECT, MAX_STORE_HOSTS, direct_target, node_targets

JOB = "j@127.0.0.1:29500"


def _entry(node: str, host: str, key: str | None = None, port: int = 0, pid: int = 100) -> RelayInfo:
    tcp = f"tcp://{host}:{port}" if key else None
    return RelayInfo(
        pid=pid, job_id=JOB, node=node, address="ipc:///r.req", pub_address="ipc:///r.pub",
        host=host, ssh_host=host, tcp_address=tcp, tcp_pub_address=tcp and f"tcp://{host}:{port + 1}",
        server_key=key,
    )  # fmt: skip


@pytest.fixture
def keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """This monitor's client pair, a real relay's server key copied into its keys directory, and
    a stranger's key (another user's relay) that it never saw."""
    from torchtop.monitor.commands import keys as keys_cli

    made = {}
    for who in ("relay", "stranger"):
        monkeypatch.setenv(curve_keys.ENV_CONFIG, str(tmp_path / who))
        made[who] = curve_keys.read_cert(keys_cli.make_pair("server")[0])[0].decode()
    monkeypatch.setenv(curve_keys.ENV_CONFIG, str(tmp_path / "monitor"))
    keys_cli.make_pair("client")
    known = curve_keys.keys_dir() / curve_keys.KNOWN_SERVERS
    known.mkdir()
    shutil.copy(tmp_path / "relay" / "keys" / "server.key", known / "node2.key")
    return made


def test_a_forged_registration_loses_to_the_one_whose_key_is_known(keys: dict[str, str]) -> None:
    real = _entry("node2", "10.0.0.2", keys["relay"], 7000)
    forged = _entry("node2", "10.6.6.6", keys["stranger"], 7000, pid=666)
    for order in ([real, forged], [forged, real]):
        notes: list[str] = []
        assert node_targets(order, notes) == [f"{DIRECT}{keys['relay']}tcp://10.0.0.2:7000"]
        assert notes == ["node2: 2 relay registrations; using the one whose key is known"]


def test_a_key_only_the_store_gives_is_never_trusted(keys: dict[str, str]) -> None:
    forged = _entry("node2", "10.0.0.2", keys["stranger"], 7000)
    assert keys["stranger"] not in curve_keys.known_server_keys()
    assert direct_target(forged) is None
    notes: list[str] = []
    assert node_targets([forged], notes) == ["ssh://10.0.0.2"]  # over ssh: ssh vouches for the host
    assert notes == []
    # two registrations naming two hosts and no known key: both are tried, and that is said
    other = _entry("node2", "10.6.6.6", keys["stranger"], 7000, pid=666)
    assert node_targets([forged, other], notes) == ["ssh://10.0.0.2", "ssh://10.6.6.6"]
    assert notes == [
        "node2: 2 relay registrations; none with a known server key: over ssh to 10.0.0.2, 10.6.6.6"
    ]


def test_a_relay_that_restarted_is_no_conflict() -> None:
    notes: list[str] = []
    again = [_entry("node1", "h1", pid=100), _entry("node1", "h1", pid=200)]
    assert node_targets(again, notes) == ["ssh://h1"] and notes == []


def test_store_hosts_are_capped_and_the_others_named() -> None:
    fakes = [_entry(f"node{i}", f"h{i}") for i in range(3000)]
    notes: list[str] = []
    targets = node_targets(fakes, notes)
    assert len(targets) == MAX_STORE_HOSTS == 1024
    (said,) = notes
    assert said.startswith("1,976 nodes of the store not reached") and "node1024, node1025" in said, said


@pytest.fixture
def master() -> Iterator[tuple[str, int]]:
    torch_distributed = pytest.importorskip("torch.distributed")
    s = torch_distributed.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10)
    )
    yield "127.0.0.1", s.port
    del s


@pytest.mark.slow  # torch's own TCPStore (its import: seconds)
def test_hostile_lines_in_the_store_drop_no_node(
    master: tuple[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchtop.monitor.link import store
    from torchtop.monitor.link.relay_targets import relays_from_store

    monkeypatch.setenv("TORCHTOP_RELAY_SSH", "1")
    for node in ("node1", "node2"):
        store.publish_relay(*master, JOB, _entry(node, node))
    good = json.loads(relay_line(_entry("node1", "node1")))
    hostile = [
        b"not json at all",
        json.dumps({**good, "pid": 2**70}).encode(),
        b"[" * 100_000 + b"]" * 100_000,
        json.dumps({**good, "address": "ipc://" + "a" * 5000}).encode(),
        json.dumps({**good, "ssh_host": "-oProxyCommand=touch /tmp/pwned"}).encode(),
        json.dumps({**good, "node": "node1", "job_id": "another@h:1"}).encode(),
    ]
    with store.StoreClient(*master) as client:
        for line in hostile:
            client.append(store.relays_key(JOB), line + b"\n")
    notes: list[str] = []
    job_id, targets = relays_from_store(master, None, notes)
    assert job_id == JOB
    assert targets == ["ssh://node1", "ssh://node2"]  # both nodes, whatever else the key holds
    (said,) = notes
    assert "6 lines of job" in said and "not a relay's entry, left out" in said, said


@pytest.mark.parametrize(
    "content, why",
    [
        (
            json.dumps(
                {
                    "kind": "relay",
                    "pid": 2147483648,
                    "job_id": "j",
                    "node": "n",
                    "address": "ipc:///a",
                    "pub_address": "ipc:///b",
                }
            ),
            "pid 2147483648 out of range",
        ),  # noqa: E501
        ("[" * 30_000 + "]" * 30_000, "not a relay entry"),
        (
            json.dumps(
                {
                    "pid": 5,
                    "job_id": "j",
                    "node": "n",
                    "address": "ipc://" + "a" * 5000,
                    "pub_address": "ipc:///b",
                }
            ),
            "address not a ipc://",
        ),  # noqa: E501
        ("x" * 70_000, "more than an entry's"),
        ([1, 2, 3], "not a relay entry"),
    ],
)
def test_a_hostile_relay_file_is_listed_with_its_reason(runtime_dir: Path, content: object, why: str) -> None:
    from torchtop.monitor.relay.registry import list_relays

    (runtime_dir / "relay-77.json").write_text(content if isinstance(content, str) else json.dumps(content))
    os.chmod(runtime_dir / "relay-77.json", 0o600)
    skipped: list[str] = []
    assert list_relays(skipped=skipped) == []
    assert len(skipped) == 1 and skipped[0].startswith("relay-77.json: ") and why in skipped[0], skipped
    assert (runtime_dir / "relay-77.json").exists()  # not ours to remove


def test_a_fifo_or_a_link_as_a_relay_file_is_never_read(runtime_dir: Path, tmp_path: Path) -> None:
    from torchtop.monitor.relay.registry import list_relays

    os.mkfifo(runtime_dir / "relay-78.json", 0o600)  # opened blocking, it would hang `ls`
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps(relay_line(_entry("n", "h", pid=os.getpid())).decode()))
    os.symlink(target, runtime_dir / "relay-79.json")
    skipped: list[str] = []
    assert list_relays(skipped=skipped) == []
    assert sorted(s.split(":")[0] for s in skipped) == ["relay-78.json", "relay-79.json"], skipped


def test_a_relay_entry_round_trips_and_a_newer_field_is_ignored() -> None:
    e = _entry("node1", "h1", "k" * 40, 7000)
    assert relay_info(relay_line(e)) == e
    assert relay_info({**e.to_json(), "from_the_future": [1, 2]}) == e
    with pytest.raises(ValueError, match="kind"):
        relay_info({**e.to_json(), "kind": "agent"})


@pytest.mark.slow  # a subprocess
def test_ls_names_a_hostile_relay_file_and_goes_on(runtime_dir: Path, subprocess_env: dict[str, str]) -> None:
    import subprocess
    import sys

    bad = {
        "kind": "relay",
        "pid": 2147483648,
        "job_id": "j",
        "node": "n",
        "address": "ipc:///a",
        "pub_address": "ipc:///b",
    }
    (runtime_dir / "relay-80.json").write_text(json.dumps(bad))
    for extra in ([], ["--json", "--relays"]):
        proc = subprocess.run(
            [sys.executable, "-m", "torchtop.monitor.commands.cli", "ls", *extra],
            env=subprocess_env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        if extra:  # what a monitor elsewhere reads over ssh: JSON on stdout, the reason on stderr
            assert json.loads(proc.stdout) == []
            assert "skipped relay-80.json: pid 2147483648 out of range" in proc.stderr, proc.stderr
