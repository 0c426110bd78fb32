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

from torchtop.agent.contract.wire import HostSample, WorkerSample

MAX_WORKERS = 64
CHILDREN_REFRESH_S = 5.0  # new child processes (workers of a new epoch) are seen within this


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
        self.cpu_count = psutil.cpu_count() or 1

    def _workers(self) -> list[WorkerSample]:
        psutil = self.psutil
        now = time.monotonic()
        if now >= self._children_due:  # listing children scans all of /proc: not every time
            self._children_due = now + CHILDREN_REFRESH_S
            try:
                kids = self.proc.children(recursive=False)[:MAX_WORKERS]
            except psutil.Error:
                kids = []
            fresh = {k.pid: self._children.get(k.pid, k) for k in kids}
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
            if pid in self._new:
                self._new.discard(pid)
                continue  # its CPU % is meaningful from the next sample on
            out.append(
                WorkerSample(
                    pid=pid, cpu_percent=cpu, rss=rss, name=name, dataloader=name == "pt_data_worker"
                )
            )
        return out

    def sample(self) -> HostSample:
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
