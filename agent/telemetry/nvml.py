"""GPU state from NVML (nvidia-ml-py's `pynvml`), matched to the process's CUDA devices.

CUDA device i of this process is NVML device CUDA_VISIBLE_DEVICES[i] (an index or a UUID), or i
when the variable is unset. Without a driver (a CPU machine) `available` is False and `reason`
says why; nothing raises. Utilisation, power and clocks are cheap: sampled with the fast tick.
PCIe throughput waits in the driver for a measuring window: `pcie()` runs on the slow thread only.
The total-energy counter (Volta+ data-center GPUs) is not cheap (4.2 ms a call on an H200): read every
ENERGY_EVERY_S; a device without it is asked once.
"""

from __future__ import annotations

import os
import time
from typing import Any

from torchtop.contract.wire import GpuSample

# the energy counter's cadence: the monitor interpolates between readings (model/energy.py), so one
# every 5 s gives a 10 s window's joules; the call took 4.2 ms on an H200 (the sample's others 0.04)
ENERGY_EVERY_S = 5.0
_THROTTLE_NAMES = {
    "GpuIdle": "idle",
    "ApplicationsClocksSetting": "app-clocks",
    "SwPowerCap": "power-cap",
    "HwSlowdown": "hw-slowdown",
    "SyncBoost": "sync-boost",
    "SwThermalSlowdown": "sw-thermal",
    "HwThermalSlowdown": "hw-thermal",
    "HwPowerBrakeSlowdown": "power-brake",
    "DisplayClockSetting": "display-clocks",
}


def visible_devices(env: str | None) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as a list of NVML selectors (indices or UUIDs); None when unset."""
    if env is None:
        return None
    out = []
    for part in env.split(","):
        part = part.strip()
        if not part or part.startswith("-"):
            break  # CUDA stops at the first invalid entry
        out.append(part)
    return out


class NvmlSampler:
    def __init__(self) -> None:
        self.available = False
        self.reason = ""
        self._handles: dict[int, Any] = {}
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.available = True
        except Exception as exc:  # broad: any NVML error (NVMLError_LibraryNotFound: no driver)
            self.reason = f"NVML not available ({type(exc).__name__})"
        self._visible = visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"))
        self._throttle_bits: list[tuple[int, str]] = []
        self._no_energy: set[int] = set()  # devices whose energy counter failed: never asked again
        self._energy_due: dict[int, float] = {}  # when each device's counter is next read (monotonic)
        self.energy_reason = ""  # why a device has no energy counter (the collector's `unavailable`)
        if self.available:
            for attr, label in _THROTTLE_NAMES.items():
                bit = getattr(self.nvml, f"nvmlClocksEventReason{attr}", None)
                bit = bit if bit is not None else getattr(self.nvml, f"nvmlClocksThrottleReason{attr}", None)
                if bit is not None:
                    self._throttle_bits.append((int(bit), label))

    def handle(self, cuda_index: int) -> Any:
        if cuda_index in self._handles:
            return self._handles[cuda_index]
        nv = self.nvml
        sel = (
            self._visible[cuda_index]
            if self._visible is not None and cuda_index < len(self._visible)
            else str(cuda_index)
        )
        if sel.isdigit():
            handle = nv.nvmlDeviceGetHandleByIndex(int(sel))
        else:
            handle = nv.nvmlDeviceGetHandleByUUID(sel if sel.startswith(("GPU-", "MIG-")) else f"GPU-{sel}")
        self._handles[cuda_index] = handle
        return handle

    def _try(self, fn: Any, *args: Any, default: Any = None) -> Any:
        try:
            return fn(*args)
        except Exception:  # broad: any NVML error: the default
            return default

    def sample(self, cuda_index: int) -> GpuSample:
        nv = self.nvml
        h = self.handle(cuda_index)
        out = GpuSample(index=cuda_index)
        name = self._try(nv.nvmlDeviceGetName, h, default="")
        out.name = name.decode() if isinstance(name, bytes) else str(name)
        util = self._try(nv.nvmlDeviceGetUtilizationRates, h)
        if util is not None:
            out.util_gpu, out.util_mem = float(util.gpu), float(util.memory)
        mem = self._try(nv.nvmlDeviceGetMemoryInfo, h)
        if mem is not None:
            out.mem_used, out.mem_total = int(mem.used), int(mem.total)
        power = self._try(nv.nvmlDeviceGetPowerUsage, h)
        if power is not None:
            out.power_w = power / 1000.0
        limit = self._try(nv.nvmlDeviceGetEnforcedPowerLimit, h)
        if limit is not None:
            out.power_limit_w = limit / 1000.0
        temp = self._try(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU)
        if temp is not None:
            out.temp_c = float(temp)
        clock = self._try(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM)
        if clock is not None:
            out.sm_clock_mhz = float(clock)
        get_reasons = (
            getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
            or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        )
        reasons = self._try(get_reasons, h)
        if reasons:
            out.throttle = [label for bit, label in self._throttle_bits if reasons & bit]
        now = time.monotonic()
        if now >= self._energy_due.get(cuda_index, 0.0):  # 4 ms a call on an H200: every 5 s
            self._energy_due[cuda_index] = now + ENERGY_EVERY_S
            out.energy_mj = self.energy(cuda_index, h)
        return out

    def energy(self, cuda_index: int, h: Any) -> int | None:
        """NVML's total energy since the driver loaded (mJ); None, and not asked again, where the
        device or driver does not support it (a retry a tick would be a storm of failed calls)."""
        if cuda_index in self._no_energy:
            return None
        fn = getattr(self.nvml, "nvmlDeviceGetTotalEnergyConsumption", None)
        try:
            got = fn(h) if fn is not None else None
        except Exception as exc:  # broad: any NVML error (NVMLError_NotSupported on pre-Volta, consumer GPUs)
            got, reason = None, type(exc).__name__
        else:
            reason = "no nvmlDeviceGetTotalEnergyConsumption in pynvml" if fn is None else f"read {got!r}"
        if isinstance(got, int) and not isinstance(got, bool) and got >= 0:
            return got
        self._no_energy.add(cuda_index)
        self.energy_reason = f"GPU {cuda_index}: energy counter not supported ({reason})"[:200]
        return None

    def pcie(self, cuda_index: int) -> tuple[float | None, float | None]:
        """(tx, rx) KB/s over NVML's sampling window; None where unsupported."""
        nv = self.nvml
        h = self.handle(cuda_index)
        tx = self._try(nv.nvmlDeviceGetPcieThroughput, h, nv.NVML_PCIE_UTIL_TX_BYTES)
        rx = self._try(nv.nvmlDeviceGetPcieThroughput, h, nv.NVML_PCIE_UTIL_RX_BYTES)
        return (None if tx is None else float(tx)), (None if rx is None else float(rx))

    def close(self) -> None:
        if self.available:
            self._try(self.nvml.nvmlShutdown)
