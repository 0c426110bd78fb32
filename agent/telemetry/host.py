"""Host figures: the training process, the machine, and each child process.

DataLoader workers are children of the training process (their main thread is named
`pt_data_worker`); their CPU % is the first thing to look at when a run is data-bound.
Runs on the agent's slow sampler thread (~1 Hz). On Linux every figure is read from /proc on
descriptors kept open (procfs.py), a child's too; psutil where that does not work.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Protocol

from torchtop.agent.telemetry.procfs import PAGE, ChildStat, ProcFs, wait_percent
from torchtop.contract.wire import HostSample, WorkerSample

MAX_WORKERS = 64
CHILDREN_REFRESH_S = 5.0  # new child processes (workers of a new epoch) are seen within this


def runqueue_wait_ns(pid: int, tid: int | None = None) -> int | None:
    """Nanoseconds the process's main thread (or its thread `tid`) has spent runnable but waiting
    for a CPU (Linux schedstat: run time, run-queue delay, time slices); None where the kernel
    does not say."""
    path = f"/proc/{pid}/schedstat" if tid is None else f"/proc/{pid}/task/{tid}/schedstat"
    try:
        with open(path, "rb") as fh:
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
            return int(os.pread(self._fd, 128, 0).split()[1]) * PAGE
        except (OSError, ValueError, IndexError):
            return 0

    def close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None


class Child(Protocol):
    """A child process's figures: (name, CPU %, RSS bytes, run-queue wait %) since the last read."""

    def read(self) -> tuple[str, float | None, int, float | None]: ...

    def close(self) -> None: ...


class _PsutilChild:
    """`Child` through psutil, where /proc is not read directly (not Linux, or it surprised us)."""

    def __init__(self, psutil: Any, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.pid = pid
        self._first = True
        self._wait: tuple[float, int] | None = None

    def read(self) -> tuple[str, float | None, int, float | None]:
        with self.proc.oneshot():
            cpu: float | None = self.proc.cpu_percent(None)
            name = self.proc.name()
            rss = self.proc.memory_info().rss
        if self._first:  # psutil's first CPU % is always 0
            self._first, cpu = False, None
        now, ns = time.monotonic(), runqueue_wait_ns(self.pid)
        last, self._wait = self._wait, (None if ns is None else (now, ns))
        wait = None
        if ns is not None and last is not None and now > last[0]:
            wait = wait_percent(ns - last[1], now - last[0])
        return name, cpu, rss, wait

    def close(self) -> None:
        pass


class TrainWait:
    """The training thread's run-queue delay over the last interval, percent (Linux schedstat of
    /proc/self/task/TID, TID its native id): on a host whose CPUs other processes also want, a
    rank is slow because it waits for a core, not because of its work. None: not known (the
    first sample, no such thread, a kernel without schedstats)."""

    def __init__(self) -> None:
        self.ident = 0  # the training thread's Python ident (the probe's tid); 0: none
        self._last: tuple[int, float, int] | None = None  # native id, monotonic s, delay ns

    def __call__(self) -> float | None:
        native = next((t.native_id for t in threading.enumerate() if t.ident == self.ident), None)
        ns = runqueue_wait_ns(os.getpid(), native) if native is not None else None
        now, last = time.monotonic(), self._last
        self._last = None if native is None or ns is None else (native, now, ns)
        if ns is None or last is None or last[0] != native or now <= last[1]:
            return None
        return wait_percent(ns - last[2], now - last[1])


class HostSampler:
    def __init__(self, pid: int | None = None) -> None:
        import psutil

        self.psutil = psutil
        self.proc = psutil.Process(pid or os.getpid())
        self.proc.cpu_percent(None)  # prime: the first call always says 0
        psutil.cpu_percent(percpu=True)
        self._children: dict[int, Child] = {}
        self._children_due = 0.0
        self.cpu_count = psutil.cpu_count() or 1
        self._procfs: ProcFs | None = None
        self._self_rss = SelfRss()
        self.train_wait = TrainWait()  # the agent names the training thread (train_wait.ident)
        if sys.platform.startswith("linux"):
            try:
                self._procfs = ProcFs()
            except (OSError, ValueError, IndexError, KeyError):
                self._procfs = None  # psutil it is

    def _workers(self) -> list[WorkerSample]:
        now = time.monotonic()
        if now >= self._children_due:  # listing children scans all of /proc: not every time
            self._children_due = now + CHILDREN_REFRESH_S
            fresh: dict[int, Child] = {}
            for pid in self._child_pids()[:MAX_WORKERS]:
                child = self._children.get(pid) or self._open_child(pid)
                if child is not None:
                    fresh[pid] = child
            for pid, child in self._children.items():
                if pid not in fresh:
                    child.close()
            self._children = fresh
        out = []
        for pid, child in list(self._children.items()):
            try:
                name, cpu, rss, wait = child.read()
            except (OSError, ValueError, IndexError, self.psutil.Error):
                self._children.pop(pid, None)  # exited
                child.close()
                continue
            if cpu is None:
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
        return out

    def _open_child(self, pid: int) -> Child | None:
        """A reader of `pid`'s figures: /proc on descriptors kept open where this process reads
        its own figures there, else psutil; None if it is gone already."""
        if self._procfs is not None:
            try:
                return ChildStat(pid)
            except OSError:
                return None  # gone already (or no /proc: then _procfs is None)
        try:
            return _PsutilChild(self.psutil, pid)
        except self.psutil.Error:
            return None

    def _child_pids(self) -> list[int]:
        pids = child_pids(self.proc.pid)
        if pids is not None:
            return pids
        try:
            return [k.pid for k in self.proc.children(recursive=False)]
        except self.psutil.Error:
            return []

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
            train_wait_percent=self.train_wait(),
        )

    def _rss(self) -> int:
        rss = self._self_rss()
        return rss if rss > 0 else self.proc.memory_info().rss

    def close(self) -> None:
        if self._procfs is not None:
            self._procfs.close()
        self._self_rss.close()
        for child in self._children.values():
            child.close()
        self._children = {}

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
            train_wait_percent=self.train_wait(),
        )


def peak_rss() -> int:
    """The process's peak resident set in bytes (0 where neither source says).

    On Linux the kernel's high-water mark of this process's own memory (VmHWM): getrusage's
    ru_maxrss keeps the peak of the process image it replaced at exec, so a small job started by
    a large parent (a notebook, `torchtop compare` run in a big process) read the parent's size."""
    try:
        with open("/proc/self/status", "rb", buffering=0) as fh:
            status = fh.read(8192)
        at = status.find(b"\nVmHWM:")
        if at >= 0:
            return int(status[at + 7 : status.index(b"kB", at)]) * 1024
    except (OSError, ValueError):
        pass
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except (ImportError, OSError):
        return 0
    return peak if sys.platform == "darwin" else peak * 1024  # macOS says bytes, Linux KiB
