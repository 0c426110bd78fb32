"""How busy the GPU really is: NVML's GPM counters (Hopper and newer), on the slow sampler thread.

NVML's utilisation is the share of time any kernel ran: a loop of tiny kernels reads 33% while
its SMs are 0.1% busy. GPM (`nvmlGpmMetricsGet`, nvidia-ml-py) reads the hardware counters
between two samples: SM activity, SM occupancy, tensor-pipe activity, DRAM bandwidth, NVLink
and PCIe throughput. One `nvmlGpmSampleGet` a device each slow tick (<= 1 Hz, median ~33 us on
an H100); the metrics are between it and the previous tick's sample. Where GPM is not supported
(older GPUs, some MIG set-ups) `reason` says so once and nothing else runs.
"""

from __future__ import annotations

from typing import Any, NamedTuple

# (field, NVML constant name): the metrics asked for, in this order
METRICS = (
    ("sm_active", "NVML_GPM_METRIC_SM_UTIL"),
    ("sm_occupancy", "NVML_GPM_METRIC_SM_OCCUPANCY"),
    ("tensor_active", "NVML_GPM_METRIC_ANY_TENSOR_UTIL"),
    ("dram_bw", "NVML_GPM_METRIC_DRAM_BW_UTIL"),
    ("nvlink_tx_mibs", "NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC"),
    ("nvlink_rx_mibs", "NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC"),
    ("pcie_tx_mibs", "NVML_GPM_METRIC_PCIE_TX_PER_SEC"),
    ("pcie_rx_mibs", "NVML_GPM_METRIC_PCIE_RX_PER_SEC"),
)


class GpmReading(NamedTuple):
    """Percentages (SM, occupancy, tensor, DRAM) and MiB/s (NVLink, PCIe); None: not reported."""

    sm_active: float | None
    sm_occupancy: float | None
    tensor_active: float | None
    dram_bw: float | None
    nvlink_tx_mibs: float | None
    nvlink_rx_mibs: float | None
    pcie_tx_mibs: float | None
    pcie_rx_mibs: float | None
    sm_clock_max_mhz: float | None = None


class GpmSampler:
    """GPM for the devices of one process. `nv` is pynvml, `handle(cuda_index)` its device."""

    def __init__(self, nv: Any, handle: Any) -> None:
        self.nv = nv
        self.handle = handle
        self.reason = ""  # why GPM is not read (said once)
        self._ids = [(field, getattr(nv, const, None)) for field, const in METRICS]
        self._prev: dict[int, Any] = {}
        self._spare: dict[int, Any] = {}
        self._supported: dict[int, bool] = {}
        self._max_clock: dict[int, float | None] = {}
        if not hasattr(nv, "nvmlGpmMetricsGet") or not hasattr(nv, "c_nvmlGpmMetricsGet_t"):
            self.reason = "GPM not in this nvidia-ml-py (upgrade it for SM and tensor activity)"

    def supported(self, d: int) -> bool:
        if self.reason:
            return False
        if d not in self._supported:
            try:
                ok = bool(self.nv.nvmlGpmQueryDeviceSupport(self.handle(d)).isSupportedDevice)
            except Exception as exc:  # broad: any NVML error means GPM unsupported (said)
                ok = False
                self.reason = f"GPM not supported on this GPU or driver ({type(exc).__name__})"
            if not ok and not self.reason:
                self.reason = "GPM not supported on this GPU (Hopper or newer; some MIG set-ups lack it)"
            self._supported[d] = ok
        return self._supported[d]

    def read(self, d: int) -> GpmReading | None:
        """Take this tick's sample; the metrics since the last one (None on the first tick)."""
        if not self.supported(d):
            return None
        nv, h = self.nv, self.handle(d)
        cur = self._spare.pop(d, None) or nv.nvmlGpmSampleAlloc()
        nv.nvmlGpmSampleGet(h, cur)
        prev = self._prev.get(d)
        self._prev[d] = cur
        if prev is None:
            return None
        self._spare[d] = prev  # reused next tick: two samples a device, allocated once
        mg = nv.c_nvmlGpmMetricsGet_t()
        mg.version = nv.NVML_GPM_METRICS_GET_VERSION
        asked = [(field, mid) for field, mid in self._ids if mid is not None]
        mg.numMetrics = len(asked)
        mg.sample1, mg.sample2 = prev, cur
        for i, (_, mid) in enumerate(asked):
            mg.metrics[i].metricId = mid
        nv.nvmlGpmMetricsGet(mg)
        values: dict[str, float | None] = {field: None for field, _ in METRICS}
        for i, (field, _) in enumerate(asked):
            m = mg.metrics[i]
            if getattr(m, "nvmlReturn", 0) == 0:
                values[field] = float(m.value)
        return GpmReading(**values, sm_clock_max_mhz=self._max(d))

    def _max(self, d: int) -> float | None:
        if d not in self._max_clock:
            try:
                self._max_clock[d] = float(
                    self.nv.nvmlDeviceGetMaxClockInfo(self.handle(d), self.nv.NVML_CLOCK_SM)
                )
            except Exception:  # broad: any NVML error: max clock unknown
                self._max_clock[d] = None
        return self._max_clock[d]

    def close(self) -> None:
        for s in [*self._prev.values(), *self._spare.values()]:
            try:
                self.nv.nvmlGpmSampleFree(s)
            except Exception:  # broad: best-effort cleanup
                pass
        self._prev.clear()
        self._spare.clear()


def counter_mfu(tensor_active: float | None, sm_clock: float | None, max_clock: float | None) -> float | None:
    """Model FLOP utilisation from the counters: tensor-pipe activity x SM clock / max clock
    (the OFU method: within ~2 points of MFU on H100/GB200), as a fraction; None if unknown."""
    if tensor_active is None or not sm_clock or not max_clock:
        return None
    return max(0.0, min(1.0, tensor_active / 100.0 * sm_clock / max_clock))
