"""The host sample from /proc on kept-open descriptors (telemetry/procfs.py) says what psutil says,
and a /proc that surprises it hands the sampling back to psutil."""

from __future__ import annotations

import sys
import time

import pytest

psutil = pytest.importorskip("psutil")
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")

from torchtop.agent.telemetry.host import HostSampler  # noqa: E402
from torchtop.agent.telemetry.procfs import ProcFs  # noqa: E402


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_procfs_figures_agree_with_psutil() -> None:
    fs = ProcFs()
    try:
        me = psutil.Process()
        me.cpu_percent(None)
        fs.proc_stat()
        _spin(0.3)
        cpu, threads = fs.proc_stat()
        theirs = me.cpu_percent(None)
        assert cpu > 20 and abs(cpu - theirs) < 30  # the same busy loop, read a moment apart
        assert threads == psutil.Process().num_threads()
        assert len(fs.cores()) == len(psutil.cpu_percent(percpu=True))
        total, available, percent = fs.memory()
        vm = psutil.virtual_memory()
        assert total == vm.total and abs(available - vm.available) < 0.05 * total
        assert 0 <= percent <= 100
    finally:
        fs.close()


def test_the_host_sampler_reads_procfs_and_falls_back_to_psutil() -> None:
    h = HostSampler()
    try:
        assert h._procfs is not None
        first = h.sample()
        assert first.cpu_count >= 1 and len(first.cpu_per_core) >= 1 and first.proc_rss > 0
        h._procfs._fds["/proc/meminfo"] = -1  # a descriptor that no longer reads
        again = h.sample()
        assert h._procfs is None  # psutil from now on
        assert again.mem_total == psutil.virtual_memory().total and again.proc_rss > 0
    finally:
        h.close()
