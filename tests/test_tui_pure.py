"""The TUI's pure parts, without a screen: formatting, panel data, capture bookkeeping, the request channel.

Synthetic steps and host figures (tests/tui_util.py) have known values, so every string and
series has an exact expected value; the feed's request channel is driven with a fake client.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys

import pytest

from tests.tui_util import GIB, HOST, MIB, T0, steps
from torchtop.contract import wire
from torchtop.monitor.link.client import AgentUnreachable
from torchtop.monitor.model import fmt
from torchtop.monitor.model.captures import CaptureBook, capture_lines, fetch_from, next_steps, progress_text
from torchtop.monitor.model.panel_data import mark_rows, memory_series, worker_rows, y_top
from torchtop.monitor.model.state import Point
from torchtop.monitor.model.steps import StepRecord
from torchtop.monitor.tui import feed


# -- pure pieces --------------------------------------------------------------------------------
def test_units_bars_and_sparks() -> None:
    assert [fmt.size(v) for v in (0, 512, 1536, 41.84 * MIB, 80 * GIB, 512 * MIB)] == [
        "0 B",
        "512 B",
        "1.50 KiB",
        "41.8 MiB",
        "80.0 GiB",
        "512 MiB",
    ]
    assert fmt.throughput(1024 * 1024) == "1.00 GiB/s"
    assert fmt.bar(0.5, 10) == "█████     " and fmt.bar(1.0, 4) == "████" and fmt.bar(0.0, 3) == "   "
    assert fmt.bar(0.55, 10) == "█████▌    "
    assert fmt.spark([0, 1, 2, 3, 4, 5, 6, 7], 8) == "▁▂▃▄▅▆▇█"
    assert fmt.spark([5.0] * 100, 10) == "▁" * 10
    assert fmt.spark([0.0, 100.0], 2, 0.0, 100.0) == "▁█"
    assert [fmt.level(x) for x in (0.5, 0.8, 0.9)] == ["ok", "warning", "critical"]
    assert fmt.number(0.123456) == "0.1235" and fmt.number(1.5e-5) == "1.500e-05"


def test_mark_rows_keep_the_most_recorded_names_in_name_order() -> None:
    recs = steps(20, marks=True)
    recs[-1] = StepRecord(i=99, t0=T0 + 1, wall_ns=1, phases={}, marks={"z_rare": 1.0, "loss": 0.5})
    rows = mark_rows(recs, names=2)
    assert [r.name for r in rows] == ["loss", "lr"]  # z_rare recorded once: left out
    assert rows[0].latest == 0.5 and len(rows[0].series) == 20 and rows[0].series[0] == 2.0


def test_memory_series_buckets_keep_the_peaks() -> None:
    pts = [Point(float(t), (5 if t == 500 else 1) * GIB, 2 * GIB, 0, -1.0, -1.0, 0) for t in range(1000)]
    s = memory_series(pts, cuda=True, device_total=80 * GIB, width=100)
    assert s.unit == "GiB" and len(s.xs) == 100 and s.limit == 80.0
    assert max(s.lines["allocated"]) == 5.0 and s.lines["reserved"][0] == 2.0
    assert s.xs[0] < -990 and s.xs[-1] < 0
    assert y_top(s) == pytest.approx(5 * 1.15)  # a small run: its own peak, so its shape shows
    assert y_top(memory_series(pts[:1], cuda=True, device_total=2 * GIB)) == 2.0  # over half: the device
    cpu = memory_series([Point(1.0, 0, 0, 0, -1.0, 50.0, 300 * MIB)], cuda=False)
    assert list(cpu.lines) == ["process RSS"] and cpu.unit == "MiB" and cpu.lines["process RSS"] == [300.0]


def test_worker_rows_put_dataloader_workers_first() -> None:
    assert [w.pid for w in worker_rows(HOST)] == [101, 102, 103]
    assert worker_rows(None) == []


def test_capture_steps_and_where_files_are() -> None:
    assert [next_steps(n, True) for n in (1, 9, 10, 50, 100)] == [2, 10, 15, 60, 100]
    assert [next_steps(n, False) for n in (1, 10, 15, 60)] == [1, 9, 10, 50]
    assert fetch_from("127.0.0.1:5555", "127.0.0.1", "box", local_host="box") is None
    assert fetch_from("127.0.0.1:5555", "127.0.0.1", "gpu7", local_host="box") == ("gpu7", [])
    assert fetch_from("10.0.0.5:5555", "10.0.0.5", "gpu7", local_host="box") == ("10.0.0.5", [])
    label = "ssh://ana@gpu7:2222/4242 (pid 4242, port 5555 via 127.0.0.1:40001)"
    assert fetch_from(label, "127.0.0.1", "gpu7.internal", local_host="box") == ("ana@gpu7", ["-P", "2222"])
    done = wire.CaptureInfo(
        id=3,
        kind=wire.CaptureKind.PROFILE,
        state=wire.CaptureState.DONE,
        steps_total=5,
        steps_done=5,
        host="gpu7",
        path="/runs/torchtop-captures/profile-1-3.pt.trace.json.gz",
        summary={"steps": 5, "step_ms": 12.5, "buckets": {"CPU Exec": 0.9, "Other": 0.1}},
    )
    lines = capture_lines(done, ("ana@gpu7", ["-P", "2222"]))
    assert lines[0] == "profile capture 3: done"
    assert lines[1] == "  file: ana@gpu7:/runs/torchtop-captures/profile-1-3.pt.trace.json.gz"
    assert lines[2] == "  fetch: scp -P 2222 ana@gpu7:/runs/torchtop-captures/profile-1-3.pt.trace.json.gz ."
    assert "5 steps of 12.5 ms: CPU Exec 90%  Other 10%" in lines[3]
    assert capture_lines(done, None)[1] == "  file: /runs/torchtop-captures/profile-1-3.pt.trace.json.gz"


def test_capture_book_announces_only_captures_that_end_while_watched() -> None:
    book = CaptureBook()
    old = wire.CaptureInfo(id=1, kind=wire.CaptureKind.PROFILE, state=wire.CaptureState.DONE, path="/x")
    assert book.see(old) is None  # finished before we attached: not news
    running = wire.CaptureInfo(
        id=2, kind=wire.CaptureKind.PROFILE, state=wire.CaptureState.RUNNING, steps_total=5, steps_done=2
    )
    assert book.see(running) is None and book.active == running
    assert progress_text(running) == "profile #2: step 2/5"
    finished = wire.CaptureInfo(
        id=2,
        kind=wire.CaptureKind.PROFILE,
        state=wire.CaptureState.DONE,
        steps_total=5,
        steps_done=5,
        path="/y",
    )
    assert book.see(finished) == finished and book.see(finished) is None  # announced once
    assert [c.id for c in book.listing()] == [2, 1] and book.active is None


def test_pure_modules_import_neither_textual_nor_zmq() -> None:
    code = (
        "import json, sys; import torchtop.monitor.model.panel_data, torchtop.monitor.model.captures, torchtop.monitor.model.fmt; "
        "print(json.dumps([m in sys.modules for m in ('textual', 'zmq', 'torch')]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stdout) == [False, False, False]


# -- the feed's request channel -----------------------------------------------------------------
class AnsweringClient:
    def __init__(self, fail: bool = False) -> None:
        self.sent: list[tuple[str, dict]] = []
        self.fail = fail

    def request(self, cmd: str, args: dict, timeout: float) -> wire.Reply:
        self.sent.append((cmd, args))
        if self.fail:
            raise AgentUnreachable("no answer")
        return wire.Reply(
            v=wire.PROTOCOL_VERSION, id=len(self.sent), ok=False, error="memory snapshots need CUDA"
        )


def test_serve_requests_sends_each_queued_request_and_posts_the_answer() -> None:
    q: queue.SimpleQueue = queue.SimpleQueue()
    q.put(("capture-memory", {"steps": 5}))
    q.put(("capture-status", {}))
    posted: list = []
    client = AnsweringClient()
    feed.serve_requests(client, q, posted.append, connected=True)  # type: ignore[arg-type]
    assert client.sent == [("capture-memory", {"steps": 5}), ("capture-status", {})]
    assert [(m.cmd, m.reply.error) for m in posted] == [
        ("capture-memory", "memory snapshots need CUDA"),
        ("capture-status", "memory snapshots need CUDA"),
    ]
    q.put(("capture-profile", {"steps": 5}))
    feed.serve_requests(AnsweringClient(fail=True), q, posted.append, connected=True)  # type: ignore[arg-type]
    assert posted[-1].reply is None and posted[-1].error == "no answer"
    q.put(("capture-profile", {"steps": 5}))
    feed.serve_requests(client, q, posted.append, connected=False)  # type: ignore[arg-type]
    assert posted[-1].error == "not connected to an agent" and len(client.sent) == 2
