"""The agent's one way to tell the user something: a line on stderr that never raises."""

from __future__ import annotations

import sys


def warn(message: str) -> None:
    """One line on stderr; never raises (stderr may be closed)."""
    try:
        print(f"torchtop: {message}", file=sys.stderr, flush=True)
    except Exception:
        pass
