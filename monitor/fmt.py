"""Human units for the TUI: milliseconds with sensible precision, counts with separators.

Pure (no textual): the same strings show up in tests, so they are defined once here.
"""

from __future__ import annotations


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


def rate(value: float) -> str:
    """Steps per second: one decimal below 100, whole numbers (with separators) above."""
    if value <= 0:
        return "0"
    if value < 100:
        return f"{value:.1f}"
    return f"{value:,.0f}"


def pct(share: float) -> str:
    """A share (0..1) as a percentage with one decimal."""
    return f"{share * 100:.1f}%"


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
