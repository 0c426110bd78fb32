"""Each diagnosis rule at its thresholds, on hand-built Facts and on a hand-built RunState."""

from __future__ import annotations

import pytest

from torchtop.agent.contract.wire import (
    PROTOCOL_VERSION,
    Batch,
    FragSample,
    HostSample,
    MemorySample,
    Telemetry,
    WorkerSample,
)
from torchtop.monitor.diagnosis.diagnose import diagnose
from torchtop.monitor.diagnosis.facts import THRESHOLDS as T
from torchtop.monitor.diagnosis.facts import Facts
from torchtop.monitor.diagnosis.flags import (
    flag_dataloader_workers,
    flag_fragmentation,
    flag_memory_leak,
    flag_memory_pressure,
)
from torchtop.monitor.diagnosis.verdicts import primary, rule_data, rule_host_overhead, rule_transfer
from torchtop.monitor.model.state import RunState
from torchtop.monitor.model.steps import StepRecord

GIB = 2**30


def facts(**shares: float) -> Facts:
    base = {"data": 0.0, "h2d": 0.0, "forward": 0.3, "backward": 0.5, "optimizer": 0.1}
    base.update(shares)
    base["other"] = max(0.0, 1.0 - sum(v for k, v in base.items() if k != "other"))
    return Facts(steps=50, step_ms=100.0, shares=base, ms={k: v * 100 for k, v in base.items()})


@pytest.mark.parametrize(
    ("share", "severity"),
    [
        (0.049, None),
        (0.05, "info"),
        (0.199, "info"),
        (0.20, "warning"),
        (0.499, "warning"),
        (0.50, "critical"),
    ],
)
def test_data_rule_bands(share: float, severity: str | None) -> None:
    got = rule_data(facts(data=share))
    assert (got.severity if got else None) == severity
    if got:
        assert got.kind == "data-loading"
        assert f"{share * 100:.0f}% of step time" in got.evidence[0]


@pytest.mark.parametrize(("share", "severity"), [(0.049, None), (0.05, "info"), (0.2, "warning")])
def test_transfer_rule_bands_host_share(share: float, severity: str | None) -> None:
    got = rule_transfer(facts(h2d=share))
    assert (got.severity if got else None) == severity


def test_transfer_rule_uses_device_copy_share() -> None:
    f = facts(h2d=0.01)
    f.device_ms = {"step": 10.0, "h2d": 3.0}
    got = rule_transfer(f)
    assert got is not None and got.severity == "warning" and got.share == pytest.approx(0.3)


def test_host_overhead_needs_cuda_and_low_util() -> None:
    f = facts()
    f.gpu_util = 30.0
    assert rule_host_overhead(f) is None  # CPU run: never host-overhead
    f.device = "cuda"
    got = rule_host_overhead(f)
    assert got is not None and got.severity == "warning"
    f.gpu_util = T["gpu_util_low"]
    assert rule_host_overhead(f) is None
    f.gpu_util = T["gpu_util_very_low"] - 1
    assert rule_host_overhead(f).severity == "critical"
    f.shares["data"] = 0.3  # a data wait explains idle GPU: not host overhead
    assert rule_host_overhead(f) is None


def test_compute_when_nothing_else() -> None:
    v = primary(facts(data=0.04, h2d=0.01))
    assert v.kind == "compute" and v.severity == "ok"
    assert v.share == pytest.approx(0.9)


def test_worst_bottleneck_wins() -> None:
    assert primary(facts(data=0.25, h2d=0.08)).kind == "data-loading"
    assert primary(facts(data=0.08, h2d=0.25)).kind == "transfer"


def test_hysteresis_keeps_verdict_just_below_threshold() -> None:
    f = facts(data=0.18, h2d=0.17)  # both moderate; data would win on share
    assert primary(f).kind == "data-loading"
    assert primary(f, previous="transfer").kind == "transfer"  # no flap on noise
    f = facts(data=0.045)  # just under the 5% band: without history, compute
    assert primary(f).kind == "compute"
    assert primary(f, previous="data-loading").kind == "data-loading"  # kept: above 0.8 x 5%
    assert primary(facts(data=0.03), previous="data-loading").kind == "compute"


def test_memory_pressure_threshold() -> None:
    f = facts()
    f.mem_total, f.reserved = 80 * GIB, int(80 * GIB * 0.89)
    assert flag_memory_pressure(f) is None
    f.reserved = int(80 * GIB * 0.90) + 1
    assert flag_memory_pressure(f).severity == "warning"
    f.reserved = int(80 * GIB * 0.98)
    assert flag_memory_pressure(f).severity == "critical"
    f.reserved, f.retry_rate = 10 * GIB, 0.5
    got = flag_memory_pressure(f)
    assert got is not None and "retries" in got.evidence[1]


def test_fragmentation_flag() -> None:
    f = facts()
    f.mem_total, f.reserved, f.allocated = 80 * GIB, 30 * GIB, 25 * GIB
    f.frag_external, f.frag_free = 0.6, 5 * GIB
    assert flag_fragmentation(f) is None  # 5 GiB free < 20% of 30 GiB reserved
    f.frag_free = 7 * GIB
    got = flag_fragmentation(f)
    assert got is not None and got.severity == "warning"
    assert any("expandable_segments" in a for a in got.advice)
    f.expandable = True
    assert not any("expandable_segments" in a for a in flag_fragmentation(f).advice)
    f.frag_external = 0.49
    assert flag_fragmentation(f) is None
    f.allocated, f.reserved = 12 * GIB, 25 * GIB  # reserved >= 2x allocated and >= 30% of device
    assert flag_fragmentation(f) is not None


def test_fragmentation_of_a_small_cache_is_normal() -> None:
    """A healthy run between steps: 2.3 GiB cached for 181 MiB live, spread over segments."""
    f = facts()
    f.mem_total, f.reserved, f.allocated = 80 * GIB, int(2.3 * GIB), 181 * 2**20
    f.frag_external, f.frag_free = 0.8, 2 * GIB
    assert flag_fragmentation(f) is None  # only 3% of the card, no retries: nothing it costs
    f.retry_rate = 0.5  # ...until cudaMalloc fails and retries while the cache holds free memory
    got = flag_fragmentation(f)
    assert got is not None and got.severity == "critical" and "retries" in got.evidence[0]


def test_dataloader_workers_flag() -> None:
    f = facts(data=0.3)
    f.cores, f.workers, f.worker_cpu = 8, 2, 98.0
    got = flag_dataloader_workers(f)
    assert got is not None and "toward 7" in got.advice[0]
    f.worker_cpu = 60.0
    assert flag_dataloader_workers(f) is None  # workers not saturated: not their fault
    f.workers = 0
    assert flag_dataloader_workers(f) is not None
    f = facts(data=0.04)
    f.workers = 0
    assert flag_dataloader_workers(f) is None


def test_memory_leak_flag() -> None:
    f = facts()
    f.growth = (1 * GIB, 1.2 * GIB, 30.0, 0.9)
    assert flag_memory_leak(f).kind == "memory-leak"
    f.growth = (1 * GIB, 1.05 * GIB, 30.0, 0.9)
    assert flag_memory_leak(f) is None  # +5%: under the 10% threshold
    f.growth = (1 * GIB, 1.5 * GIB, 30.0, 0.5)
    assert flag_memory_leak(f) is None  # not steady
    f.growth = (1 * GIB, 1.5 * GIB, 5.0, 1.0)
    assert flag_memory_leak(f) is None  # too short to say


# -- on a RunState -------------------------------------------------------------------------------
def _step(i: int, t0: float, data: float, compute: float) -> StepRecord:
    ns = {
        "data": int(data * 1e6),
        "h2d": 0,
        "forward": int(compute * 0.4e6),
        "backward": int(compute * 0.5e6),
        "optimizer": int(compute * 0.1e6),
    }
    ns["other"] = 0
    return StepRecord(i=i, t0=t0, wall_ns=sum(ns.values()), phases=ns)


def _state(data_ms: float, compute_ms: float, n: int = 80, telemetry: Telemetry | None = None) -> RunState:
    state = RunState()
    t, steps = 1000.0, []
    for i in range(n):
        steps.append(_step(i, t, data_ms, compute_ms))
        t += (data_ms + compute_ms) / 1000
    state.apply_batch(Batch(v=PROTOCOL_VERSION, run_id="r", seq=0, time=t, telemetry=telemetry), steps, 0.0)
    return state


def test_warmup_is_not_judged() -> None:
    state = _state(90.0, 10.0, n=12)
    d = diagnose(state)
    assert d.verdict.kind == "unknown" and d.steps == 2


def test_state_data_bound_with_saturated_workers() -> None:
    host = HostSample(
        proc_cpu=30,
        proc_rss=GIB,
        threads=8,
        cpu_count=4,
        workers=[
            WorkerSample(pid=p, cpu_percent=99, rss=GIB, name="pt_data_worker", dataloader=True)
            for p in (11, 12)
        ],
    )
    d = diagnose(_state(40.0, 60.0, telemetry=Telemetry(time=0, host=host)))
    assert d.verdict.kind == "data-loading" and d.verdict.severity == "warning"
    assert "dataloader-workers" in [f.kind for f in d.flags]
    assert "2 DataLoader workers at 99% CPU" in " ".join(d.verdict.evidence)


def test_state_healthy_raises_nothing() -> None:
    d = diagnose(_state(1.0, 99.0))
    assert d.verdict.kind == "compute" and d.verdict.severity == "ok" and d.flags == ()


def test_state_memory_flags_from_telemetry() -> None:
    mem = MemorySample(
        device=0,
        allocated=30 * GIB,
        reserved=76 * GIB,
        active=30 * GIB,
        requested=30 * GIB,
        inactive_split=20 * GIB,
        peak_allocated=40 * GIB,
        peak_reserved=76 * GIB,
        window_peak=40 * GIB,
        alloc_retries=0,
        ooms=0,
        device_total=80 * GIB,
    )
    frag = FragSample(device=0, largest_free=2 * GIB, total_free=40 * GIB, external=0.95, segments=500)
    d = diagnose(_state(1.0, 99.0, telemetry=Telemetry(time=0, memory=[mem], frag=[frag])))
    assert {"memory-pressure", "fragmentation"} <= {f.kind for f in d.flags}


def test_unknown_figures_are_none_and_change_no_verdict() -> None:
    """No NVML, no host sample: None, not -1. A rule that needs a figure stays silent without it;
    a known 0 is a figure (no DataLoader workers at all)."""
    f = facts(data=0.3)
    f.device = "cuda"
    assert f.gpu_util is None and f.workers is None and f.worker_cpu is None and f.proc_cpu is None
    assert rule_host_overhead(f) is None
    assert flag_dataloader_workers(f) is None  # unknown workers: no flag
    data = rule_data(f)
    assert data is not None and not any("workers" in e for e in data.evidence)
    f.workers = 0
    assert "no DataLoader worker processes" in " ".join(rule_data(f).evidence)
    assert flag_dataloader_workers(f) is not None


def test_evidence_uses_the_panels_units() -> None:
    """One set of formatters: the verdict says 41.8 MiB where the memory panel does."""
    from torchtop.monitor.model import fmt

    f = facts()
    f.mem_total, f.reserved, f.window_peak = 80 * 2**30, int(78.5 * 2**30), int(41.8 * 2**20)
    got = flag_memory_pressure(f)
    assert got is not None
    assert f"reserved {fmt.size(f.reserved)} of 80.0 GiB (98%)" in got.evidence[0]
    assert "peak allocated 41.8 MiB" in got.evidence[0]
