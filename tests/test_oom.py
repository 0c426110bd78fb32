"""Time to out-of-memory (issue 38 item 3): the limit readers on fake cgroup files, the
forecast's arithmetic and confidence, its flag, the report field, the exporter gauges, the
agent's options and the automatic snapshot's trigger on a fake capture."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from tests.test_diagnosis import _rss_state
from torchtop.agent.capture.oom_snapshot import OomSnapshot, cuda_use, parse_fraction
from torchtop.agent.start_options import StartOptions
from torchtop.agent.telemetry.memory_limit import cgroup_limit, parse_size, read_limit
from torchtop.contract.wire import MemoryLimit, MemorySample, Telemetry
from torchtop.monitor.diagnosis.diagnose import diagnose
from torchtop.monitor.diagnosis.facts import THRESHOLDS as T
from torchtop.monitor.diagnosis.facts import Facts, Growth
from torchtop.monitor.diagnosis.flags import flag_memory_leak, flag_oom_forecast
from torchtop.monitor.diagnosis.oom import confidence, forecast, limit_of
from torchtop.monitor.diagnosis.report import build_report, run_report
from torchtop.monitor.export.figures import samples

MIB, GIB = 2**20, 2**30
# a steady minute of lows: 12 MiB a step over 300 steps, tau 0.95
LEAK = Growth(40 * GIB, 40 * GIB + 3600 * MIB, 60.0, 0.95, 12 * MIB, 60, 12 * MIB, 300)


# -- the limit readers -----------------------------------------------------------------------------
def test_sizes() -> None:
    assert parse_size("12GiB") == 12 * GIB and parse_size("12 gib") == 12 * GIB
    assert parse_size("500M") == 500 * 10**6 and parse_size("1.5e9") == 1_500_000_000
    assert parse_size("4096") == 4096 and parse_size(4096) == 4096
    for bad in ("", "12 parsecs", "-1", "0", "GiB", True, None, "1" * 80):
        assert parse_size(bad) is None, bad


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_takes_the_tightest_of_its_ancestors(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    _write(root / "job" / "memory.max", f"{3 * GIB}\n")
    _write(root / "job" / "step" / "memory.max", "max\n")  # the process's own: no limit
    _write(tmp_path / "self", "0::/job/step\n")
    assert cgroup_limit(str(root), str(tmp_path / "self")) == (3 * GIB, "cgroup memory.max")
    _write(root / "job" / "step" / "memory.max", f"{GIB}\n")
    assert cgroup_limit(str(root), str(tmp_path / "self")) == (GIB, "cgroup memory.max")
    _write(tmp_path / "escape", "0::/../../etc\n")  # never read outside the mount
    assert cgroup_limit(str(tmp_path / "none"), str(tmp_path / "escape")) is None


def test_cgroup_v1_and_its_unlimited_value(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    _write(root / "memory" / "x" / "memory.limit_in_bytes", "9223372036854771712\n")  # v1's "none"
    _write(tmp_path / "self", "7:cpu,cpuacct:/x\n5:memory:/x\n")
    assert cgroup_limit(str(root), str(tmp_path / "self")) is None
    _write(root / "memory" / "memory.limit_in_bytes", f"{2 * GIB}\n")  # a container's own root
    assert cgroup_limit(str(root), str(tmp_path / "self")) == (2 * GIB, "cgroup memory.limit_in_bytes")


def test_the_limit_is_the_smallest_and_says_which(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    _write(root / "memory.max", f"{GIB}\n")
    _write(tmp_path / "self", "0::/\n")
    got = read_limit(None, str(root), str(tmp_path / "self"))
    assert got.limit <= GIB and got.source in ("cgroup memory.max", "RLIMIT_AS", "RLIMIT_DATA")
    mine = read_limit(100 * MIB, str(root), str(tmp_path / "self"))
    assert (mine.limit, mine.source, mine.user) == (100 * MIB, "TORCHTOP_MEMORY_LIMIT", 100 * MIB)
    bare = read_limit(None, str(tmp_path / "no"), str(tmp_path / "no-self"))
    assert bare.limit > 0 and bare.user == 0  # the machine's memory at least


def test_the_contract_field_is_optional_and_checked() -> None:
    t = Telemetry(time=1.0, memory_limit=MemoryLimit(limit=GIB, source="machine"))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(t), type=Telemetry) == t
    assert (
        msgspec.msgpack.decode(msgspec.msgpack.encode(Telemetry(time=1.0)), type=Telemetry).memory_limit
        is None
    )
    bad = msgspec.msgpack.encode({"time": 1.0, "memory_limit": {"limit": -1}})
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(bad, type=Telemetry)


def test_options_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHTOP_MEMORY_LIMIT", "12GiB")
    monkeypatch.setenv("TORCHTOP_OOM_SNAPSHOT_AT", "0.9")
    o = StartOptions().resolved()
    assert (o.memory_limit, o.oom_snapshot_at) == (12 * GIB, 0.9)
    assert o.resolved() == o  # resolved twice (a spawned child's deferred start): the same
    assert StartOptions(memory_limit="1GiB").resolved().memory_limit == GIB  # the caller's wins
    monkeypatch.setenv("TORCHTOP_MEMORY_LIMIT", "lots")
    monkeypatch.setenv("TORCHTOP_OOM_SNAPSHOT_AT", "90")
    o = StartOptions().resolved()
    assert (o.memory_limit, o.oom_snapshot_at) == (0, 0.0)  # said once on stderr, left out
    assert parse_fraction("0.5") == 0.5 and parse_fraction("0") is None and parse_fraction("x") is None


# -- the forecast ----------------------------------------------------------------------------------
def test_forecast_arithmetic_and_words() -> None:
    limit = int(79.6 * GIB)
    o = forecast(LEAK, 1.0, limit, "device")
    assert o is not None and o.rate == 12 * MIB and o.confidence == "high"
    left = limit - LEAK.last
    assert o.steps == pytest.approx(left / (12 * MIB)) and o.seconds == pytest.approx(o.steps / 1.0)
    assert forecast(LEAK, 2.0, limit, "device").seconds == pytest.approx(o.seconds / 2)  # type: ignore[union-attr]
    assert o.text().startswith("at +12.0 MiB a step this run reaches the 79.6 GiB limit (device) in ~")
    assert "steps, ~" in o.text() and "high confidence" in o.text()
    peak = forecast(LEAK, 1.0, limit, "device", peak=LEAK.last + 1200 * MIB)  # CUDA: counted from the peak
    assert peak is not None and peak.steps == pytest.approx(o.steps - 100)
    full = forecast(LEAK, 1.0, int(LEAK.last) - 1, "device")
    assert full is not None and full.steps == 0.0  # already past it: now


def test_no_forecast_without_a_steady_rise_a_limit_or_a_rate() -> None:
    assert forecast(None, 1.0, GIB, "machine") is None
    assert forecast(LEAK, 1.0, 0, "") is None
    assert forecast(LEAK, 0.0, 80 * GIB, "device") is None
    for g in (
        LEAK._replace(trend=0.5),
        LEAK._replace(slope=-MIB),
        LEAK._replace(recent_slope=0.1 * MIB),  # rose, then settled
        LEAK._replace(span_s=10.0),
        LEAK._replace(span_steps=20),
    ):
        assert forecast(g, 1.0, 80 * GIB, "device") is None, g


def test_confidence_words() -> None:
    assert confidence(LEAK) == "high"
    assert confidence(LEAK._replace(span_s=T.oom_moderate_s)) == "moderate"
    assert confidence(LEAK._replace(trend=0.8)) == "moderate"
    assert confidence(LEAK._replace(span_s=20.0)) == "low"
    assert confidence(LEAK._replace(trend=0.65)) == "low"


def test_the_limit_by_device() -> None:
    dev = MemorySample(0, 10, 12, 10, 10, 0, 10, 12, 10, 0, 0, device_total=80 * GIB)
    host = MemoryLimit(limit=16 * GIB, source="cgroup memory.max")
    assert limit_of(Telemetry(time=0, memory=[dev], memory_limit=host)) == (80 * GIB, "device")
    half = msgspec.structs.replace(dev, device_total=40 * GIB, limit_fraction=0.5)
    assert limit_of(Telemetry(time=0, memory=[half])) == (40 * GIB, "per-process fraction")
    assert limit_of(Telemetry(time=0, memory_limit=host)) == (16 * GIB, "cgroup memory.max")
    mine = MemoryLimit(limit=GIB, source="TORCHTOP_MEMORY_LIMIT", user=GIB)
    assert limit_of(Telemetry(time=0, memory=[dev], memory_limit=mine)) == (GIB, "TORCHTOP_MEMORY_LIMIT")
    assert limit_of(None) == (0, "") and limit_of(Telemetry(time=0)) == (0, "")


def test_the_flag_and_the_leak_evidence() -> None:
    f = Facts(1, 1000.0, {}, {}, growth=LEAK)
    f.oom = forecast(LEAK, 1.0, int(LEAK.last + 1000 * 12 * MIB), "device")  # 1,000 steps, ~17 min
    got = flag_oom_forecast(f)
    assert got is not None and got.kind == "oom-forecast" and got.severity == "warning"
    assert "~1,000 steps, ~17 min" in got.evidence[0], got.evidence
    leak = flag_memory_leak(f)
    assert leak is not None and leak.evidence[1] == got.evidence[0]
    f.oom = forecast(LEAK, 1.0, int(LEAK.last + 100 * 12 * MIB), "device")
    assert flag_oom_forecast(f).severity == "critical"  # type: ignore[union-attr]
    f.oom = forecast(LEAK, 1.0, int(LEAK.last + 3000 * 12 * MIB), "device")  # 50 min: no flag yet
    assert flag_oom_forecast(f) is None and flag_memory_leak(f) is not None


# -- on a run's state: the report and the exporter ------------------------------------------------
def _leaking(limit_mib: float) -> Any:
    """A CPU run of 1 s steps leaking 4 MiB a step past warm-up, a host limit of `limit_mib`."""
    state = _rss_state([300.0 + 4 * i for i in range(60)])
    tel = state.telemetry
    assert tel is not None
    state.telemetry = msgspec.structs.replace(
        tel, memory_limit=MemoryLimit(limit=int(limit_mib * MIB), source="cgroup memory.max")
    )
    return state


def test_report_field_and_flag_on_a_leaking_run() -> None:
    state = _leaking(536 + 4 * 400)  # 400 steps (1 s each) left past the last point
    r = build_report(state, 10.0)
    o = r["oom_forecast"]
    assert o is not None and o["limit_from"] == "cgroup memory.max", o
    assert o["steps"] == pytest.approx(400, rel=0.05) and o["seconds"] == pytest.approx(400, rel=0.05)
    assert o["rate_bytes_per_step"] == pytest.approx(4 * MIB, rel=0.01) and o["confidence"] == "high"
    assert r["memory_limit_bytes"] == (536 + 4 * 400) * MIB
    assert "oom-forecast" in r["flags"] and "memory-leak" in r["flags"]
    flat = _rss_state([300.0] * 60)
    assert build_report(flat, 10.0)["oom_forecast"] is None  # no growth: none
    assert "oom-forecast" not in [x.kind for x in diagnose(flat).flags]


def test_exporter_gauges() -> None:
    report = run_report(_leaking(536 + 4 * 400), 10.0)
    got = {s.name: s.value for s in samples(report, "j", "n", 0, True, 100, 1.0)}
    assert got["torchtop_oom_eta_seconds"] == pytest.approx(400, rel=0.05)
    assert got["torchtop_memory_limit_bytes"] == (536 + 4 * 400) * MIB
    flat = {s.name for s in samples(run_report(_rss_state([300.0] * 60), 10.0), "j", "n", 0, True, 100, 1.0)}
    assert "torchtop_oom_eta_seconds" not in flat  # no forecast: omitted


# -- the automatic snapshot (CUDA's path on a fake capture) ---------------------------------------
class _Captures:
    def __init__(self, refuse: int = 0) -> None:
        self.asked: list[tuple[str, dict[str, Any]]] = []
        self.refuse = refuse

    def request(self, cmd: str, args: dict[str, Any]) -> Any:
        self.asked.append((cmd, args))
        if len(self.asked) <= self.refuse:
            raise ValueError("busy: capture 1 (profile) is running")
        return type("Info", (), {"id": len(self.asked)})()


def test_snapshot_taken_once_past_the_share() -> None:
    caps, said = _Captures(), []
    oom = OomSnapshot(0.9, caps.request, said.append)
    oom.check(int(0.89 * GIB), GIB, cuda=True)
    assert caps.asked == [] and not said
    oom.check(int(0.91 * GIB), GIB, cuda=True)
    oom.check(int(0.95 * GIB), GIB, cuda=True)
    assert [c for c, _ in caps.asked] == ["capture-memory"] and len(said) == 1 and oom.done
    assert "91% of its 1.00 GiB limit" in said[0] and oom.reason == ""


def test_snapshot_refused_is_tried_again() -> None:
    caps = _Captures(refuse=2)
    oom = OomSnapshot(0.9, caps.request, lambda _: None)
    for _ in range(5):
        oom.check(GIB, GIB, cuda=True)
    assert len(caps.asked) == 3 and oom.done


def test_on_cpu_no_snapshot_said_once() -> None:
    caps, said = _Captures(), []
    oom = OomSnapshot(0.9, caps.request, said.append)
    for _ in range(3):
        oom.check(GIB, GIB, cuda=False)
    assert caps.asked == [] and len(said) == 1 and "no CUDA memory snapshot on CPU" in said[0]
    assert oom.reason == "no CUDA memory snapshot on CPU"


def test_cuda_use_counts_reserved_against_the_device_or_the_user() -> None:
    dev = MemorySample(0, 5 * GIB, 7 * GIB, 5, 5, 0, 5, 7, 5, 0, 0, device_total=80 * GIB)
    assert cuda_use([dev], 0) == (7 * GIB, 80 * GIB)
    assert cuda_use([dev], 6 * GIB) == (7 * GIB, 6 * GIB)
    assert cuda_use([], 0) == (0, 0)


def test_memory_panel_line() -> None:
    from torchtop.monitor.tui.widgets.memory_panel import MemoryFigures

    panel = MemoryFigures()
    panel.reason = "CUDA not in use"
    assert panel.plain() == "CUDA memory not available: CUDA not in use"  # no forecast: no line
    o = forecast(LEAK, 1.0, int(LEAK.last + 1000 * 12 * MIB), "device")
    assert o is not None
    panel.forecast = o.text()
    assert panel.plain().splitlines()[-1] == f"OOM forecast: {o.text()}"


def test_the_collector_sends_the_limit_and_says_once_there_is_no_snapshot_on_cpu() -> None:
    from torchtop.agent.telemetry.collector import TelemetryCollector

    said: list[str] = []
    c = TelemetryCollector(None, enable_gpu=False)
    try:
        c.user_limit = 4 * MIB  # under any Python process's RSS: passed at once
        c.oom = OomSnapshot(0.9, _Captures().request, said.append)
        for _ in range(3):
            c.fast()
        lim = c.latest().memory_limit
        assert lim is not None and (lim.limit, lim.source, lim.user) == (
            4 * MIB,
            "TORCHTOP_MEMORY_LIMIT",
            4 * MIB,
        )
        if c.latest().host is not None or c._rss > 0:  # RSS readable (Linux): the share is known
            assert (
                len(said) == 1 and c.latest().unavailable["oom_snapshot"] == "no CUDA memory snapshot on CPU"
            )
    finally:
        c.stop()
