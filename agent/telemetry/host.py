"""Host figures from psutil: the training process, the machine, and each child process.

DataLoader workers are children of the training process (their main thread is named
`pt_data_worker`); their CPU % is the first thing to look at when a run is data-bound.
Runs on the agent's slow sampler thread (~1 Hz): psutil's per-core CPU is too slow for the tick.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from torchtop.agent.telemetry.procfs import ProcFs
from torchtop.contract.wire import HostSample, WorkerSample

MAX_WORKERS = 64
CHILDREN_REFRESH_S = 5.0  # new child processes (workers of a new epoch) are seen within this


def runqueue_wait_ns(pid: int) -> int | None:
    """Nanoseconds the process's main thread has spent runnable but waiting for a CPU (Linux
    schedstat: run time, run-queue delay, time slices); None where the kernel does not say."""
    try:
        with open(f"/proc/{pid}/schedstat", "rb") as fh:
            return int(fh.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None


def child_pids(pid: int) -> list[int] | None:
    """The process's children, from each of its threads' /proc/PID/task/TID/children (Linux): a
    read per thread of this process instead of psutil's scan of every process on the machine
    (milliseconds of Python on a busy node, holding the GIL). None where the kernel does not say."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    out: list[int] = []
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as fh:
                out += [int(x) for x in fh.read().split()]
        except FileNotFoundError:
            if os.path.isdir(f"/proc/{pid}/task/{tid}"):
                return None  # a kernel without CONFIG_PROC_CHILDREN
        except (OSError, ValueError):
            continue  # a thread that ended meanwhile
    return out


class SelfRss:
    """This process's resident memory from /proc/self/statm, read on a descriptor kept open
    (a pread costs ~6 us, an open-read-close ~30: cheap enough for the 10 Hz fast tick, whose
    per-second low points are what the leak rule reads). 0 where there is no /proc."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self._pid = 0
        self._open()

    def _open(self) -> None:
        self._pid = os.getpid()
        try:
            self._fd = os.open("/proc/self/statm", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            self._fd = None

    def __call__(self) -> int:
        if self._fd is not None and os.getpid() != self._pid:  # a forked child: its own /proc/self
            self.close()
            self._open()
        if self._fd is None:
            return 0
        try:
            return int(os.pread(self._fd, 128, 0).split()[1]) * _PAGE
        except (OSError, ValueError, IndexError):
            return 0

    def close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None


try:
    _PAGE = os.sysconf("SC_PAGE_SIZE")
except (AttributeError, ValueError, OSError):
    _PAGE = 4096


class HostSampler:
    def __init__(self, pid: int | None = None) -> None:
        import psutil

        self.psutil = psutil
        self.proc = psutil.Process(pid or os.getpid())
        self.proc.cpu_percent(None)  # prime: the first call always says 0
        psutil.cpu_percent(percpu=True)
        self._children: dict[int, Any] = {}
        self._new: set[int] = set()
        self._children_due = 0.0
        self._waits: dict[int, tuple[float, int]] = {}  # pid -> (when, run-queue wait ns then)
        self.cpu_count = psutil.cpu_count() or 1
        self._procfs: ProcFs | None = None
        self._self_rss = SelfRss()
        if sys.platform.startswith("linux"):
            try:
                self._procfs = ProcFs()
            except (OSError, ValueError, IndexError, KeyError):
                self._procfs = None  # psutil it is

    def _workers(self) -> list[WorkerSample]:
        psutil = self.psutil
        now = time.monotonic()
        if now >= self._children_due:  # listing children scans all of /proc: not every time
            self._children_due = now + CHILDREN_REFRESH_S
            fresh = {}
            for pid in self._child_pids()[:MAX_WORKERS]:
                try:
                    fresh[pid] = self._children.get(pid) or psutil.Process(pid)
                except psutil.Error:
                    continue  # gone already
            self._new = {pid for pid in fresh if pid not in self._children}
            self._children = fresh
        out = []
        for pid, proc in list(self._children.items()):
            try:
                with proc.oneshot():
                    cpu = proc.cpu_percent(None)
                    name = proc.name()
                    rss = proc.memory_info().rss
            except psutil.Error:
                self._children.pop(pid, None)  # exited
                continue
            wait = self._wait_percent(pid, time.monotonic())
            if pid in self._new:
                self._new.discard(pid)
                continue  # its CPU % is meaningful from the next sample on
            out.append(
                WorkerSample(
                    pid=pid,
                    cpu_percent=cpu,
                    rss=rss,
                    name=name,
                    dataloader=name == "pt_data_worker",
                    wait_percent=wait,
                )
            )
        for pid in [p for p in self._waits if p not in self._children]:
            del self._waits[pid]
        return out

    def _child_pids(self) -> list[int]:
        pids = child_pids(self.proc.pid)
        if pids is not None:
            return pids
        try:
            return [k.pid for k in self.proc.children(recursive=False)]
        except self.psutil.Error:
            return []

    def _wait_percent(self, pid: int, now: float) -> float | None:
        """Percent of the time since the last sample that `pid` waited for a CPU (None: unknown)."""
        ns = runqueue_wait_ns(pid)
        if ns is None:
            return None
        last = self._waits.get(pid)
        self._waits[pid] = (now, ns)
        if last is None or now <= last[0]:
            return None
        return max(0.0, min(100.0, (ns - last[1]) / 1e9 / (now - last[0]) * 100.0))

    def sample(self) -> HostSample:
        fs = self._procfs
        if fs is not None and fs.pid == os.getpid():
            try:
                return self._sample_procfs(fs)
            except (OSError, ValueError, IndexError, KeyError, ZeroDivisionError):
                fs.close()  # /proc said something unexpected: psutil from now on
                self._procfs = None
                self.proc.cpu_percent(None)
                self.psutil.cpu_percent(percpu=True)
        return self._sample_psutil()

    def _sample_procfs(self, fs: ProcFs) -> HostSample:
        cpu, threads = fs.proc_stat()
        rss = self._rss()
        total, available, percent = fs.memory()
        return HostSample(
            proc_cpu=cpu,
            proc_rss=rss,
            threads=threads,
            cpu_count=self.cpu_count,
            cpu_per_core=fs.cores(),
            mem_total=total,
            mem_available=available,
            mem_percent=percent,
            workers=self._workers(),
            proc_rss_peak=max(peak_rss(), rss),
        )

    def _rss(self) -> int:
        rss = self._self_rss()
        return rss if rss > 0 else self.proc.memory_info().rss

    def close(self) -> None:
        if self._procfs is not None:
            self._procfs.close()
        self._self_rss.close()

    def _sample_psutil(self) -> HostSample:
        psutil = self.psutil
        with self.proc.oneshot():
            cpu = self.proc.cpu_percent(None)
            rss = self.proc.memory_info().rss
            threads = self.proc.num_threads()
        vm = psutil.virtual_memory()
        return HostSample(
            proc_cpu=cpu,
            proc_rss=rss,
            threads=threads,
            cpu_count=self.cpu_count,
            cpu_per_core=psutil.cpu_percent(percpu=True),
            mem_total=vm.total,
            mem_available=vm.available,
            mem_percent=vm.percent,
            workers=self._workers(),
            proc_rss_peak=max(peak_rss(), rss),  # the kernel's high-water mark may lag a read
        )


def peak_rss() -> int:
    """The process's peak resident set in bytes (0 where getrusage does not say)."""
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except (ImportError, OSError):
        return 0
    return peak if sys.platform == "darwin" else peak * 1024  # macOS says bytes, Linux KiB
