"""The host figures of a sample straight from Linux /proc, on descriptors kept open.

psutil spends ~0.5 ms of GIL-holding Python a sample on a loaded machine (its objects, caches
and per-call file opens: docs/benchmarks.md); the same figures are three `pread`s and a few
splits here. HostSampler uses this where it works (Linux) and psutil elsewhere, or after any
surprise here. The figures follow psutil's definitions: a process's CPU % of one core since the
last sample, a core's busy share (all time but idle and iowait, guests counted once), memory
used = total - available.
"""

from __future__ import annotations

import os
import time

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
try:
    PAGE = os.sysconf("SC_PAGE_SIZE")
except (AttributeError, ValueError, OSError):
    PAGE = 4096


class ProcFs:
    """Reads this process's and the machine's CPU and memory; raises OSError/ValueError when
    /proc does not say (the caller falls back to psutil)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
        self._fds: dict[str, int] = {}
        try:
            for name in ("/proc/stat", "/proc/meminfo", f"/proc/{self.pid}/stat"):
                self._fds[name] = os.open(name, flags)
        except OSError:
            self.close()
            raise
        # the total and one line per core come first; a line is at most ~230 bytes
        self._sizes = {"/proc/stat": 4096 + 256 * (os.cpu_count() or 1), "/proc/meminfo": 1024}
        self._sizes[f"/proc/{self.pid}/stat"] = 1024
        self._proc_last: tuple[float, int] | None = None
        self._cores_last: list[tuple[int, int]] = []
        self.proc_stat()  # primed: the first CPU % is from here on
        self.cores()

    def _read(self, name: str) -> bytes:
        return os.pread(self._fds[name], self._sizes[name], 0)

    def proc_stat(self) -> tuple[float, int]:
        """(CPU % of one core since the last call, threads) of this process."""
        fields = self._read(f"/proc/{self.pid}/stat").rpartition(b")")[2].split()
        ticks, threads = int(fields[11]) + int(fields[12]), int(fields[17])
        now = time.monotonic()
        last, self._proc_last = self._proc_last, (now, ticks)
        if last is None or now <= last[0]:
            return 0.0, threads
        return round((ticks - last[1]) / _CLK_TCK / (now - last[0]) * 100.0, 1), threads

    def cores(self) -> list[float]:
        """Each core's busy % since the last call."""
        now: list[tuple[int, int]] = []
        lines = self._read("/proc/stat").split(b"\n")
        for line in lines[:-1]:  # the last may be cut short
            if not line.startswith(b"cpu") or line[3:4] == b" ":
                if now:
                    break  # the cpuN lines come together, after the total
                continue
            v = [int(x) for x in line.split()[1:]]
            total = sum(v[:8])  # user..steal: guest time is inside user already
            now.append((total - v[3] - (v[4] if len(v) > 4 else 0), total))
        if not now or len(now) == len(lines) - 2:
            raise ValueError("/proc/stat: no per-core lines, or cut short")
        last, self._cores_last = self._cores_last, now
        if len(last) != len(now):
            return [0.0] * len(now)
        out = []
        for (busy, total), (busy0, total0) in zip(now, last):
            dt = total - total0
            out.append(round(min(100.0, max(0.0, (busy - busy0) / dt * 100.0)), 1) if dt > 0 else 0.0)
        return out

    def memory(self) -> tuple[int, int, float]:
        """(total, available, percent used) of the machine's memory, bytes."""
        got: dict[bytes, int] = {}
        for line in self._read("/proc/meminfo").split(b"\n"):
            key, _, rest = line.partition(b":")
            if key in (b"MemTotal", b"MemAvailable"):
                got[key] = int(rest.split()[0]) * 1024
                if len(got) == 2:
                    break
        total, avail = got[b"MemTotal"], got[b"MemAvailable"]
        return total, avail, round((total - avail) / total * 100.0, 1) if total else 0.0

    def close(self) -> None:
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = {}


def wait_percent(waited_ns: int, seconds: float) -> float:
    """Percent of `seconds` that `waited_ns` of run-queue delay is (a child waiting for a CPU)."""
    return max(0.0, min(100.0, waited_ns / 1e9 / seconds * 100.0))


class ChildStat:
    """One child process's figures (a DataLoader worker's) from its /proc/PID/stat and schedstat,
    on descriptors kept open: two `pread`s a sample where psutil spent ~0.3-1 ms of GIL-holding
    Python a child (its Process object, oneshot cache, three calls and a file open each). A kept
    descriptor is the process it was opened on: once that one exits, reads fail (ESRCH) and a
    new process given the same pid is never read through it. Raises OSError/ValueError when
    /proc does not say (the caller falls back to psutil or drops the child)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
        self._stat: int | None = os.open(f"/proc/{pid}/stat", flags)
        try:
            self._sched: int | None = os.open(f"/proc/{pid}/schedstat", flags)
        except OSError:
            self._sched = None  # a kernel without schedstats: no wait share, the rest stands
        self._last: tuple[float, int, int | None] | None = None  # (when, CPU ticks, run-queue wait ns)

    def read(self) -> tuple[str, float | None, int, float | None]:
        """(name, CPU % of one core, resident bytes, % of the time waiting for a CPU) since the
        last call; the percentages are None on the first call (nothing to compare with)."""
        if self._stat is None:
            raise OSError("closed")
        raw = os.pread(self._stat, 1024, 0)
        head, _, tail = raw.rpartition(b")")
        name = head.partition(b"(")[2].decode(errors="replace")
        fields = tail.split()
        ticks, rss = int(fields[11]) + int(fields[12]), int(fields[21]) * PAGE
        wait = None
        if self._sched is not None:
            try:
                wait = int(os.pread(self._sched, 128, 0).split()[1])
            except (OSError, ValueError, IndexError):
                wait = None
        now = time.monotonic()
        last, self._last = self._last, (now, ticks, wait)
        if last is None or now <= last[0]:
            return name, None, rss, None
        dt = now - last[0]
        cpu = round((ticks - last[1]) / _CLK_TCK / dt * 100.0, 1)
        waited = None
        if wait is not None and last[2] is not None:
            waited = wait_percent(wait - last[2], dt)
        return name, cpu, rss, waited

    def close(self) -> None:
        """Idempotent: a descriptor number closed twice could be another file's by then."""
        for fd in (self._stat, self._sched):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._stat = self._sched = None
