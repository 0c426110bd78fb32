"""Time to out-of-memory: when a steady growth of memory in use reaches its limit (issue 38).

From the leak rule's trend (growth.py: the Theil-Sen rate in bytes a step of the per-second lows,
Kendall's tau), the step rate over the judged window and the headroom to the limit: "at +12 MiB a
step this run reaches the 79.6 GiB limit in ~2,100 steps, ~35 min". The limit is the device's
(the share `set_per_process_memory_fraction` allows) on CUDA, the host's on CPU (the cgroup's,
the rlimits, the machine's: agent/telemetry/memory_limit.py), or the user's where it is lower.
Its confidence says how steady the rise was and over how many seconds. Pure: Facts in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, NamedTuple

from torchtop.monitor.diagnosis.facts import THRESHOLDS as T
from torchtop.monitor.diagnosis.facts import Growth
from torchtop.monitor.model.fmt import count, size

if TYPE_CHECKING:
    from torchtop.contract.wire import MemoryLimit, Telemetry

Confidence = Literal["low", "moderate", "high"]


class OomForecast(NamedTuple):
    steps: float  # training steps until memory in use reaches the limit
    seconds: float  # ... at the judged window's step rate
    limit: int  # bytes
    limit_from: str  # "device", "cgroup memory.max", "machine", "TORCHTOP_MEMORY_LIMIT" ...
    rate: float  # bytes a step (Theil-Sen)
    level: float  # bytes in use now (the fitted low at the span's end, or the window's peak)
    confidence: Confidence

    def text(self) -> str:
        """ "at +12.0 MiB a step this run reaches the 79.6 GiB limit in ~2,100 steps, ~35 min" """
        return (
            f"at +{size(self.rate)} a step this run reaches the {size(self.limit)} limit "
            f"({self.limit_from}) in ~{count(_round(self.steps))} steps, ~{when(self.seconds)} "
            f"({self.confidence} confidence)"
        )


def _round(steps: float) -> float:
    """Two significant figures: a forecast is not exact to the step."""
    if steps < 100:
        return round(steps)
    digits = len(str(int(steps))) - 2
    return round(steps, -digits)


def when(seconds: float) -> str:
    """A forecast's time: 45 s, 35 min, 2.5 h, 3 days."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.0f} days"


def rising(g: Growth | None) -> bool:
    """The growth is a steady rise worth forecasting: the leak rule's trend tests, whatever its size."""
    return (
        g is not None
        and g.first > 0
        and g.points >= T.leak_min_points
        and g.span_s >= T.leak_min_span_s
        and g.span_steps >= T.leak_min_steps
        and g.trend >= T.leak_trend
        and g.slope > 0
        and g.recent_slope >= T.leak_still * g.slope
    )


def confidence(g: Growth) -> Confidence:
    """How steady the rise (tau) and over how long: a minute of a near-straight line is high."""
    if g.trend >= T.oom_high_tau and g.span_s >= T.oom_high_s:
        return "high"
    if g.trend >= T.oom_moderate_tau and g.span_s >= T.oom_moderate_s:
        return "moderate"
    return "low"


def limit_of(tel: Telemetry | None) -> tuple[int, str]:
    """(bytes, where from) of the memory the leak rule judges: the first device's on CUDA, else
    the host's; the user's limit where it is lower. (0, "") where none is known."""
    if tel is None:
        return 0, ""
    lim: MemoryLimit | None = tel.memory_limit
    user = lim.user if lim is not None else 0
    found: list[tuple[int, str]] = []
    if tel.memory:
        m = tel.memory[0]
        if m.device_total > 0:
            found.append((m.device_total, "device" if m.limit_fraction >= 1 else "per-process fraction"))
    elif lim is not None and lim.limit > 0:
        found.append((lim.limit, lim.source or "host"))
    if user > 0:
        found.append((user, "TORCHTOP_MEMORY_LIMIT"))
    return min(found) if found else (0, "")


def forecast(
    g: Growth | None, steps_per_s: float, limit: int, limit_from: str, peak: float = 0.0
) -> OomForecast | None:
    """When memory in use reaches `limit` at the growth's rate; None without a steady rise, a
    limit or a step rate. `peak`: the most in use within a step lately (CUDA's window peak): an
    allocation at the peak is what fails, so the headroom is counted from it where higher."""
    if g is None or not rising(g) or limit <= 0 or steps_per_s <= 0:
        return None
    level = max(g.last, peak)
    steps = max(0.0, (limit - level) / g.slope)
    return OomForecast(steps, steps / steps_per_s, limit, limit_from, g.slope, level, confidence(g))
