"""Non-finite and out-of-range numbers on the wire (issue 26, item 2): rejected once, at decode
(wire.decode -> wire.bad_number), and counted as bad frames, so that a same-user process
publishing batches with NaN step times crashes neither `report` nor `export`; a user's own NaN
mark (a loss that diverged) still goes through."""

from __future__ import annotations

import io
import json
import os
import time
from contextlib import redirect_stderr, redirect_stdout

import pytest

from tests.agent_util import free_port
from tests.hostile_agent import HostileAgent, steps_log
from torchtop.contract import logcodes as L
from torchtop.contract import wire
from torchtop.monitor.commands.cli import main

V = wire.PROTOCOL_VERSION
NAN, INF = float("nan"), float("inf")


def _batch(seq: int = 0, **kw) -> wire.Batch:  # type: ignore[no-untyped-def]
    log = kw.pop("log", [wire.LogChunk(seq, 0, steps_log(10**12, 3))])
    return wire.Batch(v=V, run_id="r", seq=seq, time=kw.pop("time", time.time()), log=log, **kw)


@pytest.mark.parametrize(
    "bad",
    [
        {"wall_offset": NAN},
        {"wall_offset": INF},
        {"wall_offset": 1e300},
        {"time": NAN},
        {"log": [wire.LogChunk(0, 0, steps_log(10**12, 3, device_ms=NAN))]},
        {"log": [wire.LogChunk(0, 0, steps_log(10**12, 3, device_ms=-INF))]},
        {"log": [wire.LogChunk(0, 0, [(NAN, 1.0)])]},  # a step time that is not a time
        {"telemetry": wire.Telemetry(time=1.0, host=wire.HostSample(proc_cpu=NAN, proc_rss=1, threads=1, cpu_count=1))},
        {"why": wire.Why(stack_hz=INF)},
    ],
)  # fmt: skip
def test_decode_rejects_non_finite_and_out_of_range_numbers(bad: dict) -> None:
    frame = wire.encode(_batch(**bad))
    with pytest.raises(wire.WireError, match="out of range"):
        wire.decode(frame)


def test_decode_rejects_an_int_beyond_int64() -> None:
    hello = wire.Hello(
        v=V, run_id="r", pid=2**64 - 1, host="h", port=0, pub_port=0, device="cpu", start_time=1.0
    )
    with pytest.raises(wire.WireError, match="out of range"):
        wire.decode(wire.encode(hello))


def test_a_users_nan_mark_and_ordinary_numbers_pass() -> None:
    log = steps_log(10**12, 3, device_ms=2.5)
    log.insert(2, ((10**12 + 1) << L.SHIFT | L.MARK, "loss", NAN))
    msg = wire.decode(wire.encode(_batch(log=[wire.LogChunk(0, 0, log)], wall_offset=1.8e9)))
    assert isinstance(msg, wire.Batch) and msg.wall_offset == 1.8e9
    assert wire.bad_number(msg) is None


def _hostile_batch(seq: int) -> wire.Batch:
    """Good batches of 5 steps each, every other one spoilt a different way."""
    wall = time.time() - time.perf_counter()
    log = steps_log(time.perf_counter_ns() - 50 * 10**6, 5)
    spoilt = seq % 6
    if spoilt == 1:
        return _batch(seq, log=[wire.LogChunk(seq, 5 * seq, log)], wall_offset=NAN)
    if spoilt == 3:
        return _batch(seq, log=[wire.LogChunk(seq, 5 * seq, steps_log(time.perf_counter_ns(), 5, NAN))])
    if spoilt == 5:
        return _batch(seq, log=[wire.LogChunk(seq, 5 * seq, log)], wall_offset=wall, time=INF)
    return _batch(seq, log=[wire.LogChunk(seq, 5 * seq, log)], wall_offset=wall)


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def hostile():  # type: ignore[no-untyped-def]
    snapshot = [wire.LogChunk(0, 0, steps_log(time.perf_counter_ns() - 10**9, 5, device_ms=NAN))]
    agent = HostileAgent(_hostile_batch, snapshot)
    agent.start()
    yield agent
    agent.close()


@pytest.mark.slow  # a 2 s report; among the fast subset's slowest, ~2.0 s here (issue 27: the subset under 60 s)
def test_report_counts_nan_batches_as_bad_frames(hostile: HostileAgent) -> None:
    code, out, err = _cli("report", str(os.getpid()), "--seconds", "2")
    assert code == 0, err
    report = json.loads(out)
    assert report["bad_frames"] >= 5  # half the batches
    assert report["batches"] >= 5 and report["steps"] > 0


@pytest.mark.slow  # waits out the snapshot's 10 s timeout; among the fast subset's slowest, ~10.0 s here (issue 27: the subset under 60 s)
def test_an_invalid_reply_is_said_not_a_dead_agent(hostile: HostileAgent) -> None:
    code, out, err = _cli("report", str(os.getpid()), "--seconds", "1", "--history")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "invalid frames came back" in err and "out of range" in err


@pytest.mark.export
@pytest.mark.slow  # a 2.5 s export; among the fast subset's slowest, ~3.0 s here (issue 27: the subset under 60 s)
def test_export_survives_nan_batches(hostile: HostileAgent) -> None:
    pytest.importorskip("prometheus_client")
    code, _, err = _cli(
        "export", str(os.getpid()), "--prometheus", f"127.0.0.1:{free_port()}", "--seconds", "2.5"
    )
    assert code == 0, err
    assert "Traceback" not in err


@pytest.mark.slow  # among the fast subset's slowest, ~2.3 s here (issue 27: the subset under 60 s)
async def test_the_attach_tui_survives_nan_batches(hostile: HostileAgent) -> None:
    pytest.importorskip("textual")
    from tests.tui_util import wait_for
    from torchtop.monitor.link.targets import parse
    from torchtop.monitor.tui.app import TorchtopApp

    app = TorchtopApp(endpoint=parse(str(os.getpid())))
    async with app.run_test(size=(120, 40)) as pilot:
        ok = await wait_for(pilot, lambda: app.state.bad_frames >= 3 and len(app.state.steps) > 10, 20)
        assert ok, (app.state.bad_frames, len(app.state.steps))
        assert app.is_running
