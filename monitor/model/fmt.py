"""Human units for the TUI: milliseconds, counts, byte sizes, meters and sparklines.

Pure (no textual): the same strings show up in tests, so they are defined once here.
"""

from __future__ import annotations

from typing import Literal

Level = Literal["ok", "warning", "critical"]  # a figure against its limit: the panels' colours
LEVELS: tuple[Level, ...] = ("ok", "warning", "critical")


def ms(value: float) -> str:
    """Milliseconds with ~3 significant digits: 0.412, 4.18, 41.8, 418, 4,180."""
    if value != value or value <= 0:  # NaN or nothing measured
        return "0"
    if value < 1:
        return f"{value:.3f}"
    if value < 10:
        return f"{value:.2f}"
    if value < 100:
        return f"{value:.1f}"
    return f"{value:,.0f}"


def count(value: int | float) -> str:
    """A count with thousands separators: 1,234,567."""
    return f"{int(value):,}"


def plural(value: int | float, noun: str, nouns: str = "") -> str:
    """`noun` for a count of exactly one, else its plural (`nouns`, or noun + "s"): f"{n} {plural(n, 'step')}"."""
    return noun if value == 1 else nouns or noun + "s"


def rate(value: float) -> str:
    """Steps per second: one decimal below 100, whole numbers (with separators) above."""
    if value <= 0:
        return "0"
    if value < 100:
        return f"{value:.1f}"
    return f"{value:,.0f}"


def pct(share: float, decimals: int = 1) -> str:
    """A share (0..1) as a percentage: one decimal in tables, none in prose (`pct(x, 0)`)."""
    return f"{share * 100:.{decimals}f}%"


def duration(seconds: float) -> str:
    """A run's age: 42s, 3m 07s, 2h 05m, 3d 04h."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600:02d}h"


def size(n: int | float) -> str:
    """Bytes in binary units with ~3 significant digits: 512 B, 1.50 KiB, 41.8 MiB, 80.0 GiB."""
    if n != n or n <= 0:
        return "0 B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            break
        n /= 1024
    if unit == "B":
        return f"{int(n)} B"
    if n < 10:
        return f"{n:.2f} {unit}"
    if n < 100:
        return f"{n:.1f} {unit}"
    return f"{n:.0f} {unit}"


def throughput(kb_per_s: float) -> str:
    """NVML's PCIe KB/s as a byte rate: 812 KiB/s, 3.20 GiB/s."""
    return f"{size(kb_per_s * 1024)}/s"


def level(fraction: float, warn: float = 0.8, crit: float = 0.9) -> Level:
    """'ok', 'warning' or 'critical' for a fraction of a limit (the panels' threshold colours)."""
    if fraction >= crit:
        return "critical"
    if fraction >= warn:
        return "warning"
    return "ok"


_EIGHTHS = " ▏▎▍▌▋▊▉█"


def bar(fraction: float, width: int) -> str:
    """A meter of `width` cells filled to `fraction` (0..1) in eighths of a cell; the rest blank."""
    width = max(0, width)
    eighths = round(min(1.0, max(0.0, fraction)) * width * 8)
    full, part = divmod(eighths, 8)
    out = "█" * full + (_EIGHTHS[part] if part and full < width else "")
    return out + " " * (width - len(out))


_SPARKS = "▁▂▃▄▅▆▇█"


def buckets(values: list[float], width: int) -> list[float]:
    """At most `width` values: consecutive runs averaged, so a long series fits a row of cells."""
    if len(values) <= width or width <= 0:
        return list(values)
    step = len(values) / width
    out: list[float] = []
    for k in range(width):
        chunk = values[int(k * step) : max(int(k * step) + 1, int((k + 1) * step))]
        out.append(sum(chunk) / len(chunk))
    return out


def spark(values: list[float], width: int, lo: float | None = None, hi: float | None = None) -> str:
    """A one-line sparkline of at most `width` cells, scaled lo..hi (default: the values' min..max)."""
    if not values or width <= 0:
        return ""
    values = buckets(values, width)
    lo = min(values) if lo is None else lo
    hi = max(values) if hi is None else hi
    if hi - lo <= 0:
        return _SPARKS[0] * len(values)
    return "".join(_SPARKS[max(0, min(7, int((v - lo) / (hi - lo) * 8)))] for v in values)


def number(value: float) -> str:
    """A user scalar (a loss, an accuracy) with 4 significant digits."""
    if value != value:
        return "nan"
    if value == 0 or 1e-3 <= abs(value) < 1e5:
        return f"{value:.4g}"
    return f"{value:.3e}"
