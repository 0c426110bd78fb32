"""Energy a step from cumulative counters (issue 38, item 4): a fake NVML counter and a fake RAPL
sysfs on CPU, the pure arithmetic (model/energy.py), and the report, job report, exporter,
compare and recordings that show it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from torchtop.agent.telemetry.nvml import NvmlSampler
from torchtop.agent.telemetry.rapl import RaplReader
from torchtop.contract import wire
from torchtop.monitor.model.energy import Reading, by_source, job_energy, span_energy, step_energy
from torchtop.monitor.model.state import RunState
from torchtop.monitor.model.steps import StepRecord

T0 = 1_700_000_000.0
WATTS = 250.0
STEP_S = 0.04


def train_steps(n: int, step_s: float = STEP_S, samples: int = 32, tokens: int = 0) -> list[StepRecord]:
    wall = int(step_s * 1e9)
    return [
        StepRecord(
            i=k, t0=T0 + k * step_s, wall_ns=wall, phases={"other": wall}, samples=samples, tokens=tokens
        )
        for k in range(n)
    ]


def counter(start: float, end: float, every: float, watts: float, at: float = 5e6) -> list[Reading]:
    """A counter rising at `watts`, read every `every` s from `start` (offset from the steps' edges)."""
    out, t = [], start
    while t <= end:
        out.append(Reading(t, at + watts * (t - start)))
        t += every
    return out


# -- the arithmetic --------------------------------------------------------------------------------
def test_joules_a_step_sample_and_token_within_one_percent() -> None:
    steps = train_steps(200, samples=32, tokens=32 * 512)
    readings = {"gpu0": counter(T0 - 0.537, T0 + 9, 0.1, WATTS)}  # 100 ms reads, unaligned
    e = step_energy(readings, steps)
    assert e is not None and e.from_ == "gpu" and e.steps == 200
    want = WATTS * STEP_S
    assert e.joules_per_step == pytest.approx(want, rel=0.01)
    assert e.joules_per_sample == pytest.approx(want / 32, rel=0.01)
    assert e.joules_per_token == pytest.approx(want / (32 * 512), rel=0.01)
    assert e.watts == pytest.approx(WATTS, rel=0.01)
    assert e.joules == pytest.approx(want * 200, rel=0.01)
    assert e.sources["gpu0"].covered == pytest.approx(1.0)


def test_gpus_add_up_and_a_step_without_tokens_has_no_per_token() -> None:
    steps = train_steps(100, tokens=0)
    readings = {
        "gpu0": counter(T0 - 0.2, T0 + 5, 0.1, 300.0),
        "gpu1": counter(T0 - 0.25, T0 + 5, 0.1, 100.0, at=9e9),
        "cpu": counter(T0 - 0.3, T0 + 5, 1.0, 80.0),  # RAPL: not in a GPU run's total
    }
    e = step_energy(readings, steps)
    assert e is not None and e.from_ == "gpu"
    assert e.joules_per_step == pytest.approx(400.0 * STEP_S, rel=0.01)
    assert e.joules_per_token is None
    assert set(e.sources) == {"cpu", "gpu0", "gpu1"} and e.sources["cpu"].watts == pytest.approx(80.0)


def test_a_reset_or_wrap_drops_its_pair_and_keeps_the_rate() -> None:
    steps = train_steps(100)
    before = counter(T0 - 0.3, T0 + 1.95, 0.1, WATTS)
    after = counter(before[-1].time + 0.1, T0 + 5, 0.1, WATTS, at=12.0)  # the counter restarted
    e = step_energy({"gpu0": before + after}, steps)
    assert e is not None and e.joules_per_step == pytest.approx(WATTS * STEP_S, rel=0.01)
    assert e.sources["gpu0"].covered < 1.0  # the dropped pair's time is not covered


def test_unknown_without_a_counter_or_a_step() -> None:
    steps = train_steps(10)
    assert step_energy({}, steps) is None
    assert step_energy({"gpu0": counter(T0, T0 + 1, 0.1, WATTS)}, []) is None
    # readings all after the steps: nothing covers them
    assert span_energy(counter(T0 + 5, T0 + 6, 0.1, WATTS), T0, T0 + 1) is None
    assert span_energy([Reading(T0, 10.0), Reading(T0 + 1, 5.0)], T0, T0 + 1) is None  # only a fall


def test_the_job_sums_its_ranks_gpus_and_counts_a_nodes_rapl_once() -> None:
    steps = train_steps(100)
    e0 = step_energy({"gpu0": counter(T0 - 0.2, T0 + 5, 0.1, 200.0)}, steps)
    e1 = step_energy({"gpu0": counter(T0 - 0.2, T0 + 5, 0.1, 300.0)}, steps)
    job = job_energy({0: ("n0", e0), 1: ("n0", e1), 2: ("n1", None)})
    assert job is not None and job.from_ == "gpu"
    assert job.joules_per_step == pytest.approx(500.0 * STEP_S, rel=0.01)
    assert job.watts == pytest.approx(500.0, rel=0.01)
    assert job.joules_per_sample == pytest.approx(500.0 * STEP_S / 64, rel=0.01)  # the ranks' batches
    cpu = step_energy({"cpu": counter(T0 - 0.2, T0 + 5, 0.5, 90.0)}, steps)
    both = job_energy({0: ("n0", cpu), 1: ("n0", cpu), 2: ("n1", cpu)})
    assert both is not None and both.from_ == "cpu" and both.watts == pytest.approx(180.0, rel=0.01)
    assert job_energy({0: ("n0", None)}) is None


def test_by_source_orders_each_series() -> None:
    got = by_source([(2.0, {"gpu0": 5.0}), (1.0, {"gpu0": 3.0, "cpu": 1.0}), (3.0, None)])
    assert got == {"gpu0": [Reading(1.0, 3.0), Reading(2.0, 5.0)], "cpu": [Reading(1.0, 1.0)]}


# -- the agent: NVML's counter (a fake pynvml) and RAPL (a fake sysfs) -------------------------------
class FakeNvml:
    """pynvml's calls the sampler makes; the energy counter rises `mj` a read, or is unsupported."""

    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1

    class NVMLError_NotSupported(Exception):  # noqa: N801 (pynvml's name)
        pass

    def __init__(self, supported: bool = True) -> None:
        self.supported = supported
        self.energy_calls = 0
        self.mj = 1_000_000

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:
        return f"h{i}"

    def nvmlDeviceGetTotalEnergyConsumption(self, h: Any) -> int:
        self.energy_calls += 1
        if not self.supported:
            raise self.NVMLError_NotSupported("Not Supported")
        self.mj += 25_000
        return self.mj

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("nvmlDevice"):
            raise AttributeError(name)

        def unsupported(*args: Any) -> Any:
            raise self.NVMLError_NotSupported(name)

        return unsupported


def nvml_sampler(monkeypatch: pytest.MonkeyPatch, nv: FakeNvml) -> NvmlSampler:
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", nv)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    s = NvmlSampler()
    assert s.available
    return s


def test_nvml_energy_counter_is_read_with_the_gpu_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    nv = FakeNvml()
    s = nvml_sampler(monkeypatch, nv)
    a, skipped = s.sample(0), s.sample(0)
    assert skipped.energy_mj is None  # read every nvml.ENERGY_EVERY_S, not at every 10 Hz sample
    s._energy_due[0] = 0.0  # a second later
    b = s.sample(0)
    assert a.energy_mj is not None and b.energy_mj is not None and b.energy_mj - a.energy_mj == 25_000
    assert not s.energy_reason
    back = wire.decode(
        wire.encode(
            wire.Batch(
                v=wire.PROTOCOL_VERSION,
                run_id="r",
                seq=0,
                time=T0,
                telemetry=wire.Telemetry(time=T0, gpus=[b]),
            )
        )
    )
    assert isinstance(back, wire.Batch) and back.telemetry is not None
    assert back.telemetry.gpus[0].energy_mj == b.energy_mj


def test_an_unsupported_counter_is_asked_once_and_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    nv = FakeNvml(supported=False)
    s = nvml_sampler(monkeypatch, nv)
    for _ in range(20):
        assert s.sample(0).energy_mj is None
    assert nv.energy_calls == 1  # no retry storm at 10 Hz
    assert "not supported" in s.energy_reason and "NVMLError_NotSupported" in s.energy_reason


def rapl_dir(root: Path, packages: dict[str, tuple[int, int]]) -> None:
    for name, (uj, span) in packages.items():
        d = root / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "energy_uj").write_text(f"{uj}\n")
        (d / "max_energy_range_uj").write_text(f"{span}\n")


def test_rapl_sums_packages_undoes_a_wrap_and_skips_subdomains(tmp_path: Path) -> None:
    span = 1_000_000_000
    rapl_dir(tmp_path, {"intel-rapl:0": (990_000_000, span), "intel-rapl:1": (5_000_000, span)})
    rapl_dir(tmp_path, {"intel-rapl:0:0": (1, span), "intel-rapl-mmio:0": (1, span)})  # not packages
    r = RaplReader(str(tmp_path))
    assert r.available and r.read() == 0.0
    # package 0 wrapped: 990 J -> 1000 J (the range) -> 20 J is 30 J; package 1 rose 5 J
    rapl_dir(tmp_path, {"intel-rapl:0": (20_000_000, span), "intel-rapl:1": (10_000_000, span)})
    rapl_dir(tmp_path, {"intel-rapl:0:0": (span - 1, span)})
    assert r.read() == pytest.approx(35.0)


def test_rapl_unreadable_or_absent_is_unknown(tmp_path: Path) -> None:
    absent = RaplReader(str(tmp_path / "none"))
    assert not absent.available and absent.read() is None and "no RAPL" in absent.reason
    rapl_dir(tmp_path, {"intel-rapl:0": (5, 100)})
    (tmp_path / "intel-rapl:0" / "energy_uj").write_text("garbage")  # as unreadable as root-only
    unreadable = RaplReader(str(tmp_path))
    assert not unreadable.available and unreadable.reason == "no RAPL package counter readable"


def test_the_collector_sends_rapl_joules_from_its_fast_tick(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchtop.agent.telemetry import rapl
    from torchtop.agent.telemetry.collector import TelemetryCollector

    rapl_dir(tmp_path, {"intel-rapl:0": (1_000_000, 10**12)})
    monkeypatch.setattr(rapl, "POWERCAP", str(tmp_path))
    c = TelemetryCollector(None, enable_host=True, enable_gpu=False)
    c.fast()
    rapl_dir(tmp_path, {"intel-rapl:0": (4_000_000, 10**12)})
    c.fast()
    assert c.latest().cpu_energy_j == pytest.approx(0.0)  # read once a second, not at every fast tick
    c._rapl_due = 0.0  # a second later
    c.fast()
    assert c.latest().cpu_energy_j == pytest.approx(3.0)
    c.stop()
    monkeypatch.setattr(rapl, "POWERCAP", str(tmp_path / "none"))
    off = TelemetryCollector(None, enable_host=True, enable_gpu=False)
    off.fast()
    assert off.latest().cpu_energy_j is None and "cpu_energy" in off.latest().unavailable
    off.stop()
    assert os.path.isdir(tmp_path)


# -- the monitor: report, job report, exporter, compare, recordings ---------------------------------
def gpu_batch(k: int, steps: list[StepRecord], watts: float, run_id: str = "r", rank: int = 0) -> wire.Batch:
    """Batch k at the end of `steps`, its telemetry a GPU counter that rose `watts` since T0."""
    t = steps[-1].t0 + steps[-1].wall_ns / 1e9
    gpu = wire.GpuSample(index=0, energy_mj=round(7e6 + watts * (t - T0 + 0.3) * 1000))
    tel = wire.Telemetry(time=t, gpus=[gpu])
    return wire.Batch(v=wire.PROTOCOL_VERSION, run_id=run_id, seq=k, time=t, telemetry=tel, rank=rank)


def fed_state(watts: float | None, n: int = 250, chunk: int = 5) -> RunState:
    state = RunState()
    steps = train_steps(n)
    for k in range(0, n, chunk):
        part = steps[k : k + chunk]
        b = gpu_batch(k // chunk, part, watts or 0.0)
        if watts is None:
            b.telemetry = wire.Telemetry(time=b.time, gpus=[wire.GpuSample(index=0)])
        state.apply_batch(b, part, now=float(k))
    return state


def test_the_report_has_joules_a_step_and_unknown_without_a_counter() -> None:
    from torchtop.monitor.diagnosis.report import build_report, run_report

    got = run_report(fed_state(WATTS), 5.0).energy
    assert got is not None and got.joules_per_step == pytest.approx(WATTS * STEP_S, rel=0.01)
    assert got.watts == pytest.approx(WATTS, rel=0.01) and got.from_ == "gpu"
    assert got.joules_per_sample == pytest.approx(WATTS * STEP_S / 32, rel=0.01)
    data = build_report(fed_state(WATTS), 5.0)
    assert data["energy"]["from"] == "gpu" and data["energy"]["sources"]["gpu0"]["covered"] > 0.9
    assert build_report(fed_state(None), 5.0)["energy"] is None  # unsupported: unknown, said as null


def test_the_job_report_has_each_ranks_energy_and_their_sum() -> None:
    from tests.rank_util import hello
    from torchtop.monitor.diagnosis.job_diagnosis import build_job_report
    from torchtop.monitor.model.job_state import JobState

    job = JobState()
    per = {0: 200.0, 1: 300.0}
    for r in per:
        job.apply_hello(f"r{r}", hello(r, world=2))
    steps = train_steps(250)
    for k in range(0, 250, 5):
        for r, watts in per.items():
            part = [msgspec_replace(s, rank=r) for s in steps[k : k + 5]]
            job.apply_batch(f"r{r}", gpu_batch(k // 5, part, watts, run_id=f"run{r}", rank=r), part, now=0.0)
    data = build_job_report(job, 5.0, "job")
    ranks = {e["rank"]: e["energy"] for e in data["ranks"]}
    assert ranks[0]["joules_per_step"] == pytest.approx(200.0 * STEP_S, rel=0.01)
    assert ranks[1]["watts"] == pytest.approx(300.0, rel=0.01)
    assert data["energy"]["joules_per_step"] == pytest.approx(500.0 * STEP_S, rel=0.01)


def msgspec_replace(s: StepRecord, **kw: Any) -> StepRecord:
    import msgspec

    return msgspec.structs.replace(s, **kw)


def test_the_exporter_has_a_joules_counter_and_a_watts_gauge() -> None:
    from torchtop.monitor.diagnosis.report import run_report
    from torchtop.monitor.export.figures import METRICS, samples

    state = fed_state(WATTS)
    got = samples(run_report(state, 5.0), "j", "n", 0, True, 250, 25.0)
    by = {(s.name, dict(s.labels).get("source")): s for s in got}
    assert {s.name for s in got} <= set(METRICS)
    counter_ = by[("torchtop_energy_joules", "gpu0")]
    mj = state.telemetry.gpus[0].energy_mj if state.telemetry is not None else None
    assert mj is not None and counter_.kind == "counter" and counter_.value == pytest.approx(mj / 1000)
    assert by[("torchtop_power_watts", "gpu0")].value == pytest.approx(WATTS, rel=0.01)
    assert by[("torchtop_energy_per_step_joules", None)].value == pytest.approx(WATTS * STEP_S, rel=0.01)
    bare = samples(run_report(fed_state(None), 5.0), "j", "n", 0, True, 250, 25.0)
    assert not [s for s in bare if "energy" in s.name or "power_watts" in s.name]  # unknown: no series


def write_energy_recording(path: Path, watts: float, n: int = 120) -> None:
    from tests.recording_util import BATCH_S, batch, hello
    from torchtop.contract import recording_store as store

    w = store.RecordingWriter(path, 0, store.DEFAULT_MAX_BYTES)
    w.write(hello())
    for k in range(n):
        b = batch(k)
        gpu = wire.GpuSample(index=0, energy_mj=round(3e6 + watts * k * BATCH_S * 1000))
        b.telemetry = wire.Telemetry(time=b.time, gpus=[gpu], cpu_energy_j=50.0 * k * BATCH_S)
        w.write(b)
    w.close()


def test_a_recording_keeps_the_counters_and_replays_the_same_joules(tmp_path: Path) -> None:
    from torchtop.monitor.diagnosis.report import run_report
    from torchtop.monitor.model.playback import load

    write_energy_recording(tmp_path / "rec", 400.0)
    playback, _ = load(str(tmp_path / "rec"))
    state = playback.state_until(None)
    assert state.telemetry is not None and state.telemetry.cpu_energy_j == pytest.approx(50.0 * 119 * 0.1)
    e = run_report(state, 5.0).energy
    assert e is not None and e.joules_per_step == pytest.approx(400.0 * 0.01, rel=0.01)  # 10 ms steps
    assert e.sources["cpu"].watts == pytest.approx(50.0, rel=0.01)


def test_compare_shows_the_energy_rows(tmp_path: Path) -> None:
    from tests.test_compare import rows, run_cli
    from torchtop.monitor.model.compare import render_text

    write_energy_recording(tmp_path / "a", 400.0)
    write_energy_recording(tmp_path / "b", 200.0)
    code, out, _ = run_cli("compare", str(tmp_path / "a"), str(tmp_path / "b"), "--json")
    assert code == 0
    import json

    result = json.loads(out)
    r = rows(result)
    assert r["energy.per_step"]["values"][0] == pytest.approx(4.0, rel=0.02)
    assert r["energy.per_step"]["values"][1] == pytest.approx(2.0, rel=0.02)
    assert r["energy.per_step"]["changes"][0]["verdict"] == "better"
    assert "energy.per_token" not in r  # no tokens seen: no row
    assert "joules/step" in render_text(result)


def test_the_gpu_panel_shows_joules_a_step_and_nothing_when_unknown() -> None:
    from torchtop.monitor.tui.widgets.gpu_panel import GpuPanel

    steps = train_steps(100)
    two = step_energy(
        {"gpu0": counter(T0 - 0.2, T0 + 5, 0.1, 300.0), "gpu1": counter(T0 - 0.2, T0 + 5, 0.1, 100.0)}, steps
    )
    panel = GpuPanel()
    panel.gpus = [wire.GpuSample(index=0, name="H200"), wire.GpuSample(index=1, name="H200")]
    panel.energy = two
    text = panel.plain(120)
    assert "12 J/step" in text and "4 J/step" in text and "all GPUs" in text and "16 J/step" in text
    assert "0.5 J/sample" in text and "400 W mean" in text
    panel.energy = None
    assert "J/step" not in panel.plain(120)
    cpu = GpuPanel()
    cpu.reason = "CUDA not in use"
    cpu.energy = step_energy({"cpu": counter(T0 - 0.2, T0 + 5, 0.5, 60.0)}, steps)
    assert "CPU energy (RAPL)" in cpu.plain(120) and "2.4 J/step" in cpu.plain(120)


def test_an_older_peers_telemetry_decodes_with_energy_unknown() -> None:
    import msgspec

    old = {"time": T0, "gpus": [{"index": 0, "name": "A100"}], "steps": 3}  # no energy fields
    tel = msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=wire.Telemetry)
    assert tel.cpu_energy_j is None and tel.gpus[0].energy_mj is None
    assert b"energy" not in msgspec.msgpack.encode(tel)  # unset: left out of the frame
