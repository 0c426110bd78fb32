"""Host figures from psutil: the training process, the machine, and each child process.

DataLoader workers are children of the training process (their main thread is named
`pt_data_worker`); their CPU % is the first thing to look at when a run is data-bound.
Runs on the agent's slow sampler thread (~1 Hz): per-core CPU alone costs ~100 us.
"""

from __future__ import annotations

import os
from typing import Any

from .wire import HostSample, WorkerSample

MAX_WORKERS = 64


class HostSampler:
    def __init__(self, pid: int | None = None) -> None:
        import psutil

        self.psutil = psutil
        self.proc = psutil.Process(pid or os.getpid())
        self.proc.cpu_percent(None)  # prime: the first call always says 0
        psutil.cpu_percent(percpu=True)
        self._children: dict[int, Any] = {}
        self.cpu_count = psutil.cpu_count() or 1

    def _workers(self) -> list[WorkerSample]:
        psutil = self.psutil
        try:
            kids = self.proc.children(recursive=False)
        except psutil.Error:
            return []
        seen: dict[int, Any] = {}
        out = []
        for kid in kids[:MAX_WORKERS]:
            proc = self._children.get(kid.pid, kid)
            try:
                with proc.oneshot():
                    first = kid.pid not in self._children
                    cpu = proc.cpu_percent(None)
                    name = proc.name()
                    rss = proc.memory_info().rss
            except psutil.Error:
                continue
            seen[kid.pid] = proc
            if first:
                continue  # its CPU % is meaningful from the next sample on
            out.append(
                WorkerSample(pid=kid.pid, cpu_percent=cpu, rss=rss, name=name, dataloader=name == "pt_data_worker")
            )
        self._children = seen
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
        )
