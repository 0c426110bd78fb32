"""Memory, GPU and host sampling on the agent's threads, never the training thread.

`fast()` runs in the agent loop's tick: allocator stats and NVML's cheap figures. A separate
1 Hz thread takes what is slow: psutil (per-core CPU, children), NVML PCIe throughput (it waits
in the driver), the allocator snapshot for fragmentation (adaptive rate). Each sampler that fails
repeatedly is switched off and its reason reported in `unavailable`; none ever raises.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from torchtop.agent.telemetry.host import SelfRss
from torchtop.agent.telemetry.memory_limit import LIMIT_PERIOD_S, read_limit
from torchtop.agent.telemetry.memory_trend import MemoryTrend
from torchtop.contract.wire import FragSample, GpuSample, HostSample, MemoryLimit, MemorySample, Telemetry

if TYPE_CHECKING:
    from collections.abc import Callable

    from torchtop.agent.capture.oom_snapshot import OomSnapshot
    from torchtop.agent.cuda_use import CudaUse
    from torchtop.agent.telemetry.cuda_memory import CudaMemorySampler
    from torchtop.agent.telemetry.flight import FlightReader
    from torchtop.agent.telemetry.gpm import GpmReading, GpmSampler
    from torchtop.agent.telemetry.host import HostSampler
    from torchtop.agent.telemetry.nvml import NvmlSampler
    from torchtop.agent.telemetry.rapl import RaplReader

SLOW_PERIOD_S = 1.0
UNATTENDED_SLOW_PERIODS = 10  # nobody subscribed: the slow samplers run every this many periods
DEVICE_REFRESH_S = 5.0
# NVML's PCIe throughput waits ~20 ms in the driver a direction and costs ~1 ms of CPU a call on
# an H200 (bench_samplers.py): at 1 Hz that was most of the slow thread's cost a step; every 10 s
# it is a link's steady rate all the same
PCIE_PERIOD_S = 10.0
MAX_FAILURES = 5


T = TypeVar("T")


class _Breaker:
    """A failure counter per sampler: after MAX_FAILURES it is off, with the last error as reason."""

    def __init__(self, name: str, unavailable: dict[str, str]) -> None:
        self.name = name
        self.failures = 0
        self.unavailable = unavailable

    @property
    def on(self) -> bool:
        return self.failures < MAX_FAILURES

    def run(self, fn: Callable[..., T], *args: Any) -> T | None:
        try:
            return fn(*args)
        except Exception as exc:  # broad: a sampler's failure is counted and trips the breaker, never raised
            self.failures += 1
            if not self.on:
                self.unavailable[self.name] = f"disabled after errors: {type(exc).__name__}: {exc}"[:200]
            return None


class TelemetryCollector:
    def __init__(self, cuda: CudaUse | None, enable_host: bool = True, enable_gpu: bool = True) -> None:
        self.cuda = cuda  # None: never look for CUDA
        self.unavailable: dict[str, str] = {}
        self.busy_ns = 0  # the slow thread's CPU time at work
        self.attended = False  # a subscriber is on the stream (the agent thread says so)
        self.recording = False  # a recording is kept: the host is sampled at the start too
        self._memory: list[MemorySample] = []
        self._frag: list[FragSample] = []
        self._gpus: list[GpuSample] = []
        self._pcie: dict[int, tuple[float | None, float | None]] = {}
        self._pcie_due = 0.0  # monotonic time of the next PCIe reading
        self._gpm: dict[int, GpmReading] = {}
        self._gpm_sampler: GpmSampler | None = None
        self._host: HostSample | None = None
        self._rss = 0  # this process's RSS at the last fast tick (0: not read)
        self._self_rss = SelfRss()
        self.trend = MemoryTrend()  # per-second lows, for monitors that join later
        self.user_limit = 0  # bytes: TORCHTOP_MEMORY_LIMIT / start(memory_limit=) (core sets it)
        self.oom: OomSnapshot | None = None  # the automatic snapshot near the limit (core sets it)
        self._limit: MemoryLimit | None = None
        self._limit_due = 0.0  # monotonic time of the next read of the host's limits
        self.step_count: Callable[[], int] | None = None  # training steps so far (the agent loop sets it)
        self.flight: FlightReader | None = None  # torch's flight recorder, read while stalled (core sets it)
        self._devices: list[int] = []
        self._devices_at = 0.0
        self._cuda_mem: CudaMemorySampler | None = None
        self._nvml: NvmlSampler | None = None
        self._host_sampler: HostSampler | None = None
        self._rapl: RaplReader | None = None
        self._cpu_energy_j: float | None = None  # RAPL's joules at its last reading (once a second)
        self._rapl_due = 0.0
        self._breakers = {
            n: _Breaker(n, self.unavailable)
            for n in ("memory", "frag", "gpu", "pcie", "gpm", "host", "cpu_energy")
        }
        self._stop = threading.Event()
        self._slow_lock = threading.Lock()  # the slow thread, and a last host sample at stop
        self._thread: threading.Thread | None = None
        self.enable_host = enable_host
        self.train_thread: Callable[[], int] = lambda: 0  # the training thread's ident (the agent's probe)
        self.enable_gpu = enable_gpu
        self.unavailable["memory"] = "CUDA not in use"
        if enable_host:
            self._host_sampler = self._breakers["host"].run(self._make_host)
            if self._host_sampler is None:
                self.unavailable.setdefault("host", "psutil not available")
        else:
            self.unavailable["host"] = "disabled"
        self._rapl = self._breakers["cpu_energy"].run(self._make_rapl) if enable_host else None
        if self._rapl is not None and not self._rapl.available:
            self.unavailable["cpu_energy"] = self._rapl.reason
            self._rapl = None

    @staticmethod
    def _make_rapl() -> RaplReader:
        from torchtop.agent.telemetry.rapl import RaplReader

        return RaplReader()

    @staticmethod
    def _make_host() -> HostSampler:
        from torchtop.agent.telemetry.host import HostSampler

        return HostSampler()

    # -- CUDA state ----------------------------------------------------------------------------
    def _cuda_ready(self) -> bool:
        """True once the user's code initialised CUDA; sets the CUDA samplers up on first sight."""
        if self._cuda_mem is not None:
            return True
        if self.cuda is None or not self.cuda.initialised():
            return False
        from torchtop.agent.telemetry.cuda_memory import CudaMemorySampler

        self._cuda_mem = CudaMemorySampler(self.cuda.torch)
        self.unavailable.pop("memory", None)
        if self.enable_gpu:
            from torchtop.agent.telemetry.nvml import NvmlSampler

            nvml = NvmlSampler()
            if nvml.available:
                self._nvml = nvml
                from torchtop.agent.telemetry.gpm import GpmSampler

                self._gpm_sampler = GpmSampler(nvml.nvml, nvml.handle)
            else:
                self.unavailable["gpu"] = nvml.reason
        return True

    def _devices_now(self, cuda_mem: CudaMemorySampler) -> list[int]:
        now = time.monotonic()
        if not self._devices or now - self._devices_at > DEVICE_REFRESH_S:
            found = self._breakers["memory"].run(cuda_mem.devices)
            if found:
                self._devices = found
            self._devices_at = now
        return self._devices

    # -- sampling ------------------------------------------------------------------------------
    def fast(self) -> None:
        """10 Hz: allocator stats and NVML's cheap figures; the process's RSS (a memory leak on
        CPU shows in its per-second low points, which a 1 Hz sample cannot give)."""
        if self._host_sampler is not None:
            self._rss = self._self_rss()
        now = time.monotonic()
        if self._rapl is not None and self._breakers["cpu_energy"].on and now >= self._rapl_due:
            self._rapl_due = now + 1.0  # sysfs reads a package: once a second, as NVML's counter (nvml.py)
            self._cpu_energy_j = self._breakers["cpu_energy"].run(self._rapl.read)
        if self.flight is not None:  # reads nothing unless the steps stopped (flight.py)
            self.flight.poll(self._steps())
            if self.flight.failed:
                self.unavailable["flight_recorder"] = self.flight.failed
        try:
            self._fast_cuda()
        finally:
            allocated = self._memory[0].allocated if self._memory else 0
            if self._rss > 0 or allocated > 0:
                self.trend.add(time.time(), self._rss, allocated, self._steps())
            self._near_limit()

    def _near_limit(self) -> None:
        """The host's memory limit (re-read every LIMIT_PERIOD_S), and the automatic snapshot's check."""
        try:
            now = time.monotonic()
            if now >= self._limit_due:
                self._limit_due = now + LIMIT_PERIOD_S
                self._limit = read_limit(self.user_limit)
            oom = self.oom
            if oom is None or oom.done:
                return
            if self._memory:
                from torchtop.agent.capture.oom_snapshot import cuda_use

                oom.check(*cuda_use(self._memory, self.user_limit), cuda=True)
            elif self._limit is not None:
                oom.check(self._rss, self._limit.limit, cuda=False)
            if oom.reason:
                self.unavailable["oom_snapshot"] = oom.reason
        except Exception:  # broad: the limit and the snapshot's check never end the agent's tick
            pass

    def _steps(self) -> int | None:
        try:
            return self.step_count() if self.step_count is not None else None
        except Exception:  # broad: a step-count callback's failure: unknown
            return None

    def _fast_cuda(self) -> None:
        cuda_mem = self._cuda_mem if self._cuda_ready() else None
        if cuda_mem is None:
            if self.enable_gpu and "gpu" not in self.unavailable:
                self.unavailable["gpu"] = "CUDA not in use"
            return
        devices = self._devices_now(cuda_mem)
        mem = self._breakers["memory"]
        if mem.on:
            samples = [s for s in (mem.run(cuda_mem.stats, d) for d in devices) if s is not None]
            self._memory = samples
        gpu = self._breakers["gpu"]
        if self._nvml is not None and gpu.on:
            gpus = []
            for d in devices:
                s = gpu.run(self._nvml.sample, d)
                if s is not None:
                    s.pcie_tx_kbs, s.pcie_rx_kbs = self._pcie.get(d, (None, None))
                    g = self._gpm.get(d)
                    if g is not None:
                        s.sm_active, s.sm_occupancy, s.tensor_active, s.dram_bw = g[:4]
                        s.nvlink_tx_mibs, s.nvlink_rx_mibs, s.sm_clock_max_mhz = g[4], g[5], g[8]
                    gpus.append(s)
            self._gpus = gpus
            if self._nvml.energy_reason:
                self.unavailable["gpu_energy"] = self._nvml.energy_reason

    def slow(self, host_only: bool = False) -> None:
        """1 Hz: host, PCIe throughput, fragmentation (when due)."""
        with self._slow_lock:
            self._slow(host_only)

    def _slow(self, host_only: bool) -> None:
        if self._host_sampler is not None and self._breakers["host"].on:
            wait = getattr(self._host_sampler, "train_wait", None)  # (a test's stand-in has none)
            if wait is not None:
                wait.ident = self.train_thread()
            host = self._breakers["host"].run(self._host_sampler.sample)
            if host is not None:
                self._host = host
        if self._cuda_mem is None or host_only:
            return
        devices = list(self._devices)
        if self._nvml is not None and self._breakers["pcie"].on and time.monotonic() >= self._pcie_due:
            self._pcie_due = time.monotonic() + PCIE_PERIOD_S
            for d in devices:
                got = self._breakers["pcie"].run(self._nvml.pcie, d)
                if got is not None:
                    self._pcie[d] = got
        self._slow_gpm(devices)
        frag = self._breakers["frag"]
        if devices and frag.on and self._cuda_mem.snapshot_due():
            got = frag.run(self._cuda_mem.frag, devices)
            if got is not None:
                self._frag = got

    def _slow_gpm(self, devices: list[int]) -> None:
        """GPM counters since the last slow tick (<= 1 Hz); unsupported: said once, not asked again."""
        gpm, breaker = self._gpm_sampler, self._breakers["gpm"]
        if gpm is None or not breaker.on:
            return
        for d in devices:
            got = breaker.run(gpm.read, d)
            if got is not None:
                self._gpm[d] = got
        if gpm.reason:
            self.unavailable["gpm"] = gpm.reason
            self._gpm_sampler = None
            gpm.close()

    def latest(self) -> Telemetry:
        host = self._host
        if host is not None and self._rss > 0 and host.proc_rss != self._rss:
            host = msgspec.structs.replace(host, proc_rss=self._rss)
        return Telemetry(
            time=time.time(),
            memory=list(self._memory),
            frag=list(self._frag),
            gpus=list(self._gpus),
            host=host,
            unavailable=dict(self.unavailable),
            steps=self._steps(),
            cpu_energy_j=self._cpu_energy_j,
            collectives=list(self.flight.groups) if self.flight is not None else [],
            memory_limit=self._limit,
        )

    # -- the slow thread -----------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="torchtop-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        quiet = 0
        if self.recording:  # a short run's recording has the host's figures too
            try:
                self.slow(host_only=True)
            except Exception:  # broad: the sampler thread outlives any sample's failure
                pass
        while not self._stop.wait(SLOW_PERIOD_S):
            quiet = 0 if self.attended else quiet + 1
            if quiet % UNATTENDED_SLOW_PERIODS != 0:
                continue  # nobody is watching: host, PCIe and fragmentation every 10 s only
            busy = time.thread_time_ns()
            try:
                self.slow()
            except Exception:  # broad: the sampler thread outlives any sample's failure
                pass
            self.busy_ns += time.thread_time_ns() - busy

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(2.0)
        if self._gpm_sampler is not None:
            self._gpm_sampler.close()
        if self._nvml is not None:
            self._nvml.close()
        close = getattr(self._host_sampler, "close", None)
        if close is not None:
            try:
                close()
            except Exception:  # broad: best-effort cleanup
                pass
        self._self_rss.close()
