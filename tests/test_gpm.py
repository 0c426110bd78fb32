"""GPM (NVML's GPU performance counters) with a fake pynvml, on CPU: the sampler, the panel, the flag."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from torchtop.agent.telemetry.gpm import METRICS, GpmSampler
from torchtop.contract.wire import GpuSample
from torchtop.monitor.diagnosis.facts import Facts
from torchtop.monitor.diagnosis.gpm import GpmFigures, counter_mfu, flag_mfu_disagree, util_words
from torchtop.monitor.tui.widgets.gpu_panel import gpu_lines


class FakeGpm:
    """pynvml's GPM calls: counters that advance by `rates` a sample; or no support at all."""

    NVML_GPM_METRICS_GET_VERSION = 1
    NVML_CLOCK_SM = 0

    def __init__(self, supported: bool = True, values: dict[str, float] | None = None) -> None:
        self.supported = supported
        self.values = values or {}
        self.samples = 0
        self.allocs = 0
        self.freed = 0
        for k, (_, const) in enumerate(METRICS):
            setattr(self, const, 100 + k)
        self._ids = {100 + k: field for k, (field, _) in enumerate(METRICS)}

    def nvmlGpmQueryDeviceSupport(self, h: Any) -> Any:
        return SimpleNamespace(isSupportedDevice=int(self.supported))

    def nvmlGpmSampleAlloc(self) -> Any:
        self.allocs += 1
        return SimpleNamespace(n=None)

    def nvmlGpmSampleGet(self, h: Any, s: Any) -> Any:
        self.samples += 1
        s.n = self.samples
        return s

    def nvmlGpmSampleFree(self, s: Any) -> None:
        self.freed += 1

    def c_nvmlGpmMetricsGet_t(self) -> Any:
        return SimpleNamespace(
            metrics=[SimpleNamespace(metricId=0, value=0.0, nvmlReturn=0) for _ in range(16)]
        )

    def nvmlGpmMetricsGet(self, mg: Any) -> Any:
        assert mg.sample2.n == mg.sample1.n + 1  # the previous tick's sample, then this one's
        for m in mg.metrics[: mg.numMetrics]:
            field = self._ids[m.metricId]
            if field in self.values:
                m.value = self.values[field]
            else:
                m.nvmlReturn = 3  # not supported on this device
        return mg

    def nvmlDeviceGetMaxClockInfo(self, h: Any, clock: int) -> int:
        return 1980


def test_the_sampler_reads_the_counters_between_two_ticks() -> None:
    nv = FakeGpm(values={"sm_active": 0.1, "tensor_active": 0.0, "sm_occupancy": 2.0, "dram_bw": 1.0})
    gpm = GpmSampler(nv, lambda d: f"handle{d}")
    assert gpm.read(0) is None  # the first tick: one sample, no interval yet
    got = gpm.read(0)
    assert got is not None and got.sm_active == 0.1 and got.tensor_active == 0.0 and got.sm_occupancy == 2.0
    assert got.nvlink_tx_mibs is None  # not reported: None, not zero
    assert got.sm_clock_max_mhz == 1980
    for _ in range(5):
        gpm.read(0)
    assert nv.allocs == 2  # two samples a device, reused
    gpm.close()
    assert nv.freed == 2 and not gpm.reason


def test_unsupported_gpm_is_said_once_and_not_asked_again() -> None:
    nv = FakeGpm(supported=False)
    gpm = GpmSampler(nv, lambda d: d)
    assert gpm.read(0) is None and gpm.read(0) is None
    assert "GPM not supported" in gpm.reason
    assert nv.samples == 0


def test_the_panel_shows_sm_activity_beside_nvml_util() -> None:
    g = GpuSample(index=0, name="H100", util_gpu=33.0, sm_active=0.1, tensor_active=0.0, sm_occupancy=2.0)
    assert util_words(g) == "33% · SMs 0% busy"
    text = "\n".join(t.plain for t in gpu_lines(g, 100))
    assert "util" in text and "33% · SMs 0% busy" in text and "tensor 0%" in text
    plain = GpuSample(index=0, util_gpu=33.0)
    assert util_words(plain) == "33%"  # no GPM: today's figure alone


def test_counter_mfu_is_tensor_activity_scaled_by_the_clock() -> None:
    g = GpuSample(index=0, tensor_active=92.9, sm_clock_mhz=1755.0, sm_clock_max_mhz=1980.0)
    assert abs(counter_mfu(g) - 0.929 * 1755 / 1980) < 1e-9  # type: ignore[operator]
    assert counter_mfu(GpuSample(index=0, tensor_active=50.0)) is None


def _facts(counter: float, flop: float) -> Facts:
    f = Facts(steps=50, step_ms=10.0, shares={}, ms={}, device="cuda")
    f.gpm = GpmFigures(90.0, counter * 100, counter)
    f.why = SimpleNamespace(throughput=SimpleNamespace(mfu=flop, flop_mfu=flop))  # type: ignore[assignment]
    return f


def test_mfu_disagreement_is_flagged_at_ten_points() -> None:
    assert flag_mfu_disagree(_facts(0.45, 0.40)) is None
    low = flag_mfu_disagree(_facts(0.45, 0.12))
    assert low is not None and low.kind == "mfu-disagree" and "misses work" in low.advice[0]
    high = flag_mfu_disagree(_facts(0.05, 0.40))
    assert high is not None and "idle" in high.advice[0]
