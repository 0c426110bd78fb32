"""Hostile discovery files (issue 37): anything of this user's can write into the runtime
directory, so `ls`, `report`, `capture` and `attach` read every file there with care. A file
that is no agent's entry (a pid no process can have, deep nesting, a 5,000-character address, a
non-object, a huge file, a FIFO, a link, a directory) is said in one line and the command exits
normally: no traceback, no hang, and the file is left where it is. `export` and a node's relay,
which list the agents again every few seconds, skip such files and go on serving the good agent."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest

from tests.agent_util import free_port
from tests.hostile_agent import HostileAgent, steps_log
from torchtop.contract import discovery, wire
from torchtop.monitor.commands.cli import main

GOOD_IPC = ("ipc:///tmp/x.req", "ipc:///tmp/x.pub")


def _json(doc: object) -> Callable[[Path], object]:
    return lambda path: path.write_text(json.dumps(doc))


def _text(text: str) -> Callable[[Path], object]:
    return lambda path: path.write_text(text)


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _link(path: Path) -> None:  # to a good entry elsewhere: still never followed
    target = path.parent.parent / f"elsewhere-{path.name}"
    target.write_text(json.dumps({"pid": os.getpid(), "address": GOOD_IPC[0], "pub_address": GOOD_IPC[1]}))
    path.symlink_to(target)


def _long_address(n: int) -> Callable[[Path], object]:
    doc = {"pid": os.getpid(), "address": f"ipc:///{'a' * n}.req", "pub_address": f"ipc:///{'a' * n}.pub"}
    return _json(doc)


HOSTILE: dict[str, Callable[[Path], object]] = {
    "pid 2**31": _json({"pid": 2**31}),
    "pid 2**64": _json({"pid": 2**64}),
    "pid 10**30": _json({"pid": 10**30}),
    "negative pid": _json({"pid": -5}),
    "pid past pid_max": _json({"pid": (1 << 22) + 1}),  # Linux's ceiling
    "deep nesting": _text('{"pid": 1, "a": ' + "[" * 30_000 + "]" * 30_000 + "}"),
    "5,000-character address": _long_address(5000),
    "ipc path past sun_path": _long_address(200),
    "control characters in the address": _json(
        {"pid": os.getpid(), "address": "ipc:///tmp/\x1b[2J.req", "pub_address": GOOD_IPC[1]}
    ),
    "not an object": _json([1, 2]),
    "huge file": _text('{"pid": 1, "pad": "' + "x" * 200_000 + '"}'),
    "not UTF-8": lambda path: path.write_bytes(b'{"pid": 1, "x": "\xff\xfe"}'),
    "FIFO": _fifo,
    "symbolic link": _link,
    "directory": lambda path: path.mkdir(),
}


@pytest.fixture
def _deadline() -> Iterator[None]:
    """A hang (a FIFO opened for reading blocks) fails the test instead of the run."""

    def expired(*_: object) -> None:
        raise TimeoutError("the command hung on a discovery file")

    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return
    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, 30)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.usefixtures("_deadline")
@pytest.mark.parametrize("kind", list(HOSTILE))
def test_a_hostile_file_is_said_in_one_line_and_every_reader_exits_normally(
    runtime_dir: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    path = runtime_dir / "agent-4242.json"
    HOSTILE[kind](path)
    assert main(["ls"]) == 0
    out, err = capsys.readouterr()
    said = [line for line in out.splitlines() if str(path) in line or "unusable" in line]
    assert len(said) == 1 and err == "", (out, err)  # skipped with its reason, or listed as unusable
    for argv in (["report", "--seconds", "0.1"], ["capture"], ["attach"]):
        assert main(argv) == 2, argv
        out, err = capsys.readouterr()
        assert out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (argv, err)
    assert main(["ls", "--json"]) == 0
    out, err = capsys.readouterr()
    assert isinstance(json.loads(out), list) and len(err.strip().splitlines()) <= 1
    assert path.exists() or path.is_symlink()  # said, never removed: it is not provably a stale entry of ours


def test_a_good_entry_beside_hostile_ones_is_still_listed(runtime_dir: Path) -> None:
    for i, make in enumerate(HOSTILE.values()):
        make(runtime_dir / f"agent-{90000 + i}.json")
    good = discovery.AgentInfo(pid=os.getpid(), address=GOOD_IPC[0], pub_address=GOOD_IPC[1])
    discovery.write(good)
    agents, skipped = discovery.scan()
    usable = [a for a in agents if a.unusable is None]
    assert [a.pid for a in usable] == [os.getpid()] and usable[0].address == GOOD_IPC[0]
    assert len(skipped) + len(agents) - len(usable) == len(HOSTILE)
    assert all(s.reason and "\n" not in s.reason for s in skipped)


def test_the_agents_own_entry_always_reads_back(runtime_dir: Path) -> None:
    """What an agent writes fits what a reader accepts: a command line of any length is clipped."""
    argv = ["train.py", *(f"--opt{i}={'v' * 5000}" for i in range(400))]
    info = discovery.AgentInfo(pid=os.getpid(), address=GOOD_IPC[0], pub_address=GOOD_IPC[1], argv=argv)
    path = discovery.write(info)
    assert path.stat().st_size <= discovery.MAX_FILE_BYTES
    (listed,) = discovery.list_agents()
    assert listed.unusable is None and listed.argv is not None and listed.argv[0] == "train.py"


def test_pid_range() -> None:
    assert discovery.pid_in_range(1) and discovery.pid_in_range(discovery.pid_max())
    for pid in (0, -1, discovery.pid_max() + 1, 2**31, 2**64, True, "12", None):
        assert not discovery.pid_in_range(pid)


def test_an_ipc_target_past_sun_path_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", f"ipc:///{'a' * 300}.req", "--seconds", "0.1"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "at most 107 bytes" in err, err


def test_ls_escapes_control_characters_on_every_line(
    runtime_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A job's ranks are listed under a job line: their host and the job id come from files anyone
    of this user's can write, so neither may move the cursor or retitle the terminal."""
    evil = "\x1b[2J\x1b]0;pwned\x07"
    for rank, pid in enumerate((os.getpid(), os.getppid())):
        info = discovery.AgentInfo(
            pid=pid, address=f"ipc:///tmp/x{rank}.req", pub_address=f"ipc:///tmp/x{rank}.pub",
            host=f"node{evil}", job_id=f"job{evil}@h:1", rank=rank, world_size=2,
        )  # fmt: skip
        discovery.write(info)
    assert main(["ls"]) == 0
    out = capsys.readouterr().out
    assert "rank   1" in out and "\x1b" not in out and "\x07" not in out, out
    assert "\\x1b" in out  # escaped, not dropped: the text is still there to read


def _good_batch(seq: int) -> wire.Batch:
    """5 training steps of 5 ms, ending now: a live agent's batch."""
    log = steps_log(time.perf_counter_ns() - 50 * 10**6, 5)
    return wire.Batch(
        v=wire.PROTOCOL_VERSION, run_id="hostile", seq=seq, time=time.time(),
        log=[wire.LogChunk(seq, 5 * seq, log)], wall_offset=time.time() - time.perf_counter(), rank=0,
    )  # fmt: skip


@pytest.mark.slow  # a 3 s export beside a live fake agent
@pytest.mark.export
@pytest.mark.usefixtures("_deadline")
def test_export_beside_every_hostile_file_exports_the_good_agent(
    runtime_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from prometheus_client.parser import text_string_to_metric_families  # pyright: ignore[reportMissingImports]  # the export extra

    for i, make in enumerate(HOSTILE.values()):
        make(runtime_dir / f"agent-{90000 + i}.json")
    good = HostileAgent(_good_batch)  # a same-process agent: its entry names this (live) pid
    good.start()
    port = free_port()
    scraped: list[dict[str, float]] = []
    stop = threading.Event()

    def scrape() -> None:  # /metrics while it runs, until the good agent's steps are there
        while not stop.is_set() and not (scraped and scraped[-1].get("torchtop_steps_total", 0) > 0):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                    text = r.read().decode()
            except OSError:
                stop.wait(0.2)
                continue
            families = text_string_to_metric_families(text)
            scraped.append({s.name: s.value for f in families for s in f.samples})
            stop.wait(0.2)

    scraper = threading.Thread(target=scrape, daemon=True)
    scraper.start()
    try:
        code = main(["export", "--prometheus", f"127.0.0.1:{port}", "--seconds", "3"])
    finally:
        stop.set()
        scraper.join(5)
        good.close()
    out, err = capsys.readouterr()
    assert code == 0 and "Traceback" not in err, err
    assert all(line.startswith("torchtop") for line in err.splitlines()), err
    assert scraped and scraped[-1].get("torchtop_steps_total", 0) > 0, scraped[-1:]
    assert len(list(runtime_dir.glob("agent-9*.json"))) == len(HOSTILE)  # said nowhere, removed never


@pytest.mark.slow  # a relay run for ~1 s, a rescan every 0.1 s
@pytest.mark.usefixtures("_deadline")
def test_a_relay_rescanning_beside_hostile_files_stays_up_and_serves_its_agent(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import zmq

    from torchtop.monitor.relay import node

    job = "hostile-job@node0:29500"
    for i, doc in enumerate(
        (
            {"pid": 2**31, "job_id": job, "rank": 1, "address": GOOD_IPC[0], "pub_address": GOOD_IPC[1]},
            {"pid": (1 << 22) + 1, "job_id": job, "rank": 2, "address": GOOD_IPC[0], "pub_address": GOOD_IPC[1]},
            *(
                {"pid": os.getppid(), "job_id": job, "rank": 3, "address": f"ipc:///{'a' * n}.req",
                 "pub_address": f"ipc:///{'a' * n}.pub"}
                for n in (5000, 200)  # past the entry's length; past sun_path (a live pid, not the agent's)
            ),
        )
    ):  # fmt: skip
        _json(doc)(runtime_dir / f"agent-{90000 + i}.json")
    HOSTILE["deep nesting"](runtime_dir / "agent-90009.json")
    good = HostileAgent(_good_batch)
    good.hello = msgspec.structs.replace(good.hello, job_id=job, rank=0, world_size=4)
    info = discovery.AgentInfo(
        pid=os.getpid(), address=good.req, pub_address=good.pub, job_id=job, rank=0, world_size=4,
        run_id=good.run_id, start_time=time.time(),
    )  # fmt: skip
    discovery.write(info)  # the agent's entry, now of the relay's job
    good.start()
    monkeypatch.setattr(node, "RESCAN_S", 0.1)
    relay = node.Relay(job, "node0")
    rescans = [0]
    rescan = relay.rescan

    def counted(now: float) -> None:
        rescans[0] += 1
        rescan(now)

    relay.rescan = counted  # type: ignore[method-assign]
    halt = threading.Event()
    thread = threading.Thread(target=relay.run, args=(halt, 3600.0), daemon=True)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, node.SUMMARY_TOPIC)
    sub.connect(relay.pub_address)
    thread.start()
    got: list[wire.NodeSummary] = []
    try:
        end = time.monotonic() + 10
        while time.monotonic() < end and not (rescans[0] >= 5 and got and got[-1].ranks[0].batches > 0):
            if sub.poll(100):
                msg = wire.decode(sub.recv_multipart()[1])
                assert isinstance(msg, wire.NodeSummary)
                got.append(msg)
        assert thread.is_alive()  # no rescan raised
    finally:
        halt.set()
        thread.join(5)
        sub.close(linger=0)
        ctx.term()
        relay.ctx.destroy(linger=0)  # every socket, also one a failed rescan left open: term never hangs
        relay.close()
        good.close()
    assert rescans[0] >= 5 and got, (rescans, len(got))
    assert [rs.rank for rs in got[-1].ranks] == [0] and got[-1].ranks[0].batches > 0, got[-1]
    assert any(rs.hello is not None and rs.hello.job_id == job for s in got for rs in s.ranks)
    assert not got[-1].ranks[0].gone and got[-1].duplicates == []
