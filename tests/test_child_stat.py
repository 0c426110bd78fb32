"""A child process's figures (a DataLoader worker's) read from /proc on descriptors kept open
(agent/telemetry/procfs.py: ChildStat), as psutil reads them, without psutil per sample."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from torchtop.agent.telemetry.host import HostSampler
from torchtop.monitor.diagnosis.facts import worker_busy

MIB = 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_childs_figures_come_from_proc_as_psutil_reads_them_and_no_psutil_call_per_sample(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The slow thread read each child with psutil (~0.3-1 ms of GIL-holding Python a child a
    second); now two preads on descriptors kept open. The figures are psutil's: name, RSS and the
    CPU % of a child that burns CPU, and none of psutil's Process calls runs per sample."""
    import psutil

    spin = "import time\nx = bytearray(64 << 20)\nprint('ready', flush=True)\nwhile True: pass"
    kid = subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE, text=True)
    sampler = HostSampler()
    try:
        assert kid.stdout is not None and kid.stdout.readline().strip() == "ready"
        sampler._children_due = 0.0  # the child started after the sampler: list children now
        sampler.sample()  # first sight of the child

        def no_psutil(*args: object, **kwargs: object) -> None:
            raise AssertionError("psutil called per sample")

        monkeypatch.setattr(psutil.Process, "cpu_percent", no_psutil)
        monkeypatch.setattr(psutil.Process, "memory_info", no_psutil)
        monkeypatch.setattr(psutil.Process, "name", no_psutil)
        time.sleep(1.0)
        seen = {w.pid: w for w in sampler.sample().workers}
        monkeypatch.undo()
        truth = psutil.Process(kid.pid)
        w = seen[kid.pid]
        assert w.name == truth.name() and not w.dataloader
        assert abs(w.rss - truth.memory_info().rss) < 8 * MIB and w.rss > 64 * MIB, w
        # a busy loop: on a CPU or waiting for one for the whole second (a loaded machine)
        assert (worker_busy(w.cpu_percent, w.wait_percent) or 0.0) > 60, w
        kid.kill()
        kid.wait()
        assert kid.pid not in {w.pid for w in sampler.sample().workers}  # gone: dropped, not a stale read
        assert kid.pid not in sampler._children
    finally:
        if kid.poll() is None:
            kid.kill()
            kid.wait()
        sampler.close()
