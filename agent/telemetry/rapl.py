"""The CPU packages' energy from RAPL (/sys/class/powercap/intel-rapl:N/energy_uj), where readable.

Each package's counter wraps at its max_energy_range_uj: a reading below the last one is a wrap,
undone here, so the total only grows. Only packages (intel-rapl:N), not their subdomains
(intel-rapl:N:M), which the package's figure already holds. Since 2020 kernels often let only root
read energy_uj: then `available` is False and `reason` says why. Runs on the slow thread.
"""

from __future__ import annotations

import os
import re

POWERCAP = "/sys/class/powercap"
_PACKAGE = re.compile(r"intel-rapl:\d+")
_MAX_BYTES = 32  # a counter is a decimal integer: a longer file is not one


def _read_int(path: str) -> int | None:
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_BYTES + 1)
    except OSError:
        return None
    if len(raw) > _MAX_BYTES:
        return None
    text = raw.strip()
    return int(text) if text.isdigit() else None


class RaplReader:
    """Joules the CPU packages used since the first `read()`; None where no package is readable."""

    def __init__(self, root: str | None = None) -> None:
        root = POWERCAP if root is None else root
        self.reason = ""
        self._domains: list[tuple[str, int]] = []  # (energy_uj path, its wrap range)
        try:
            names = sorted(n for n in os.listdir(root) if _PACKAGE.fullmatch(n))
        except OSError:
            names = []
        for name in names:
            base = os.path.join(root, name)
            span = _read_int(os.path.join(base, "max_energy_range_uj"))
            path = os.path.join(base, "energy_uj")
            if span and _read_int(path) is not None:
                self._domains.append((path, span))
        if not self._domains:
            self.reason = (
                "no RAPL package counter readable"
                if names
                else "no RAPL counters (/sys/class/powercap/intel-rapl:*)"
            )
        self._last: dict[str, int] = {}
        self._total_uj = 0

    @property
    def available(self) -> bool:
        return bool(self._domains)

    def read(self) -> float | None:
        """The packages' joules since the first read, wraps undone; None when none is readable."""
        if not self._domains:
            return None
        got = False
        for path, span in self._domains:
            now = _read_int(path)
            if now is None or now > span:
                continue
            got = True
            last = self._last.get(path)
            self._last[path] = now
            if last is not None:
                # one wrap between reads at most: a package wraps in minutes, read every few seconds
                self._total_uj += now - last if now >= last else now + span - last
        return self._total_uj / 1e6 if got else None
