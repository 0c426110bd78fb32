"""A node's relay with real agents: local rank 0 starts it, it publishes both ranks' summaries,
forwards requests and one rank's full stream while asked, registers in the job's rendezvous
store (a real torch TCPStore, read back without torch), and when it dies its ranks show as not
reporting while the view goes on, until its agent starts it again. TORCHTOP_RELAY=0 starts none."""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from remote_util import TRAIN

from tests.agent_util import free_port
from torchtop.contract import discovery
from torchtop.contract.relay import RelayInfo
from torchtop.monitor.diagnosis.job_diagnosis import build_job_report
from torchtop.monitor.link import store
from torchtop.monitor.link.job_link import FOLLOW, JobLink, apply_events
from torchtop.monitor.link.targets import from_discovery
from torchtop.monitor.model.job_state import JobState
from torchtop.monitor.relay.registry import list_relays

pytestmark = pytest.mark.slow


@pytest.fixture
def master() -> Iterator[tuple[str, int]]:
    import torch.distributed as dist

    s = dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]  # torch re-exports it
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10)
    )
    yield "127.0.0.1", s.port
    del s


def _start(tmp_path: Path, env: dict[str, str], ranks: int, store_port: int, relay: str = "1") -> list:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    procs = []
    for r in range(ranks):
        e = {
            **env,
            "TORCHELASTIC_RUN_ID": "relaytest",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store_port),
            "WORLD_SIZE": str(ranks),
            "RANK": str(r),
            "LOCAL_RANK": str(r),
            "TORCHTOP_RELAY": relay,
        }
        log = (tmp_path / f"rank{r}.log").open("wb")
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), "300"], env=e, stdout=log, stderr=subprocess.STDOUT
            )
        )
    return procs


def _wait(cond, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.3)
    return False


def _feed(link: JobLink, job: JobState, seconds: float, until=None) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        apply_events(job, link.poll(0.2), time.monotonic())
        if until is not None and until():
            return


def test_a_relay_serves_its_node_and_its_death_is_shown(
    tmp_path: Path, subprocess_env: dict[str, str], master: tuple[str, int]
) -> None:
    procs = _start(tmp_path, subprocess_env, 2, master[1])
    link = None
    try:
        assert _wait(lambda: len(list_relays()) == 1, 90), (tmp_path / "rank0.log").read_text()[-800:]
        (entry,) = list_relays()
        assert entry.job_id == "relaytest@127.0.0.1:" + str(master[1])
        # registered in the job's store, read back without torch: endpoints, no secrets
        assert _wait(lambda: store.read_relays(*master, entry.job_id).entries != [], 30)
        (stored,) = store.read_relays(*master, entry.job_id).entries
        assert stored.address == entry.address and not any("secret" in k for k in stored.to_json())
        link = JobLink([], relays=[from_discovery(discovery.entry(entry.to_json()), label="node-a")])
        job = JobState()
        _feed(
            link,
            job,
            60,
            lambda: len(job.ranked()) == 2 and all(m.stats.window(10).steps for m in job.ranked()),
        )
        assert [m.rank for m in job.ranked()] == [0, 1]
        # a request for each rank goes through the relay and back; one rank's stream while followed
        link.request("hello", {}, None)
        link.request(FOLLOW, {}, [job.ranked()[1].key])
        replies, streamed = [], []
        end = time.monotonic() + 20
        while time.monotonic() < end and (len(replies) < 2 or not streamed):
            events = link.poll(0.2)
            apply_events(job, events, time.monotonic())
            replies += [e for e in events if e.kind == "reply"]
            streamed += [e for e in events if e.kind == "stream"]
        assert sorted(e.reply.hello.rank for e in replies if e.reply and e.reply.ok) == [0, 1]
        assert {e.key for e in streamed} == {job.ranked()[1].key}
        assert job.ranked()[1].state.steps and not job.ranked()[0].state.steps

        def coverage_line() -> str:
            return build_job_report(job, 3, "x", 10, time.monotonic())["coverage"]["line"]

        # both ranks current: a rank starved of CPU for 3 s (a loaded machine) is not, until it steps again
        _feed(link, job, 30, lambda: coverage_line() == "2 of 2 ranks reporting")
        assert coverage_line() == "2 of 2 ranks reporting"
        # a capture asked of the job reaches every rank through the relay, and its answers come back
        link.request("capture-profile", {"steps": 2}, None)
        answers: list = []
        end = time.monotonic() + 30
        while time.monotonic() < end and len(answers) < 2:
            events = link.poll(0.2)
            apply_events(job, events, time.monotonic())
            answers += [e for e in events if e.kind == "reply" and e.cmd == "capture-profile"]
        assert sorted((e.key, e.reply.ok) for e in answers) == [(m.key, True) for m in job.ranked()], [
            (e.key, e.error, e.reply and e.reply.error) for e in answers
        ]
        assert all(e.reply.capture is not None and e.reply.capture.kind == "profile" for e in answers)
        # the relay dies: its ranks are not reporting, the view says so and goes on
        os.kill(entry.pid, signal.SIGKILL)
        _feed(
            link,
            job,
            30,
            lambda: "silent" in build_job_report(job, 3, "x", 10, time.monotonic())["coverage"]["line"],
        )
        report = build_job_report(job, 3, "x", 10, time.monotonic())
        assert report["coverage"]["reporting"] == 0, report["coverage"]
        assert {e["status"] for e in report["ranks"]} == {"not reporting"}
        # rank 0's agent starts it again (after 10 s): the node reports again on the same socket
        _feed(
            link,
            job,
            60,
            lambda: build_job_report(job, 3, "x", 10, time.monotonic())["coverage"]["reporting"] == 2,
        )
        assert (
            build_job_report(job, 3, "x", 10, time.monotonic())["coverage"]["line"]
            == "2 of 2 ranks reporting"
        )
        assert list_relays()[0].pid != entry.pid
    finally:
        if link is not None:
            link.close()
        for p in procs:
            p.kill()
            p.wait()


def test_no_relay_when_turned_off(
    tmp_path: Path, subprocess_env: dict[str, str], master: tuple[str, int]
) -> None:
    procs = _start(tmp_path, subprocess_env, 2, master[1], relay="0")
    try:
        from torchtop.monitor.link.targets import local_agents

        assert _wait(lambda: len(local_agents()) == 2, 90)
        time.sleep(3)  # the agents' once-a-second chores have run
        assert list_relays() == []
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_the_store_client_speaks_torchs_protocol(master: tuple[str, int]) -> None:
    import torch.distributed as dist

    torch_side = dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]  # torch re-exports it
        *master, is_master=False, timeout=datetime.timedelta(seconds=10)
    )
    append = torch_side.append  # pyright: ignore[reportAttributeAccessIssue]  # the stub lacks Store.append
    entry = RelayInfo(pid=7, job_id="j@h:1", node="a", address="ipc:///x", pub_address="ipc:///y")
    store.publish_relay(*master, "j@h:1", entry)
    b = {**entry.to_json(), "node": "b"}
    append(store.relays_key("j@h:1"), json.dumps(b) + "\n")
    append(store.relays_key("j@h:1"), json.dumps({**b, "job_id": "other", "node": "c"}) + "\n")
    got = store.read_relays(*master, "j@h:1")
    assert [e.node for e in got.entries] == ["a", "b"]  # another job's line left out, and counted
    assert got.skipped == 1 and "an entry of job other" in got.reasons[0]
    assert json.loads(torch_side.get(store.relays_key("j@h:1")).splitlines()[0])["node"] == "a"
    assert store.read_relays(*master, "nothing@h:1").entries == []


def test_an_unreachable_store_is_one_line_that_says_what_to_do() -> None:
    with pytest.raises(store.StoreError) as err:
        store.read_relays("127.0.0.1", free_port(), "j@h:1", timeout=2)
    text = str(err.value)
    assert "\n" not in text and "rendezvous store at 127.0.0.1" in text and "--store HOST:PORT" in text
