"""The agent's one way to tell the user something (a line on stderr), and the one way it keeps
torch's warnings about its own doings out of the user's output without leaving a filter behind.

A quiet start: by default a job prints one line, rank 0's, saying where to attach (`announce`);
what the agent does meanwhile is said with TORCHTOP_VERBOSE=1 (`notice`); problems always
(`warn`), each once where it is raised."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from typing import Any, cast


def warn(message: str) -> None:
    """One line on stderr; never raises (stderr may be closed)."""
    try:
        print(f"torchtop: {message}", file=sys.stderr, flush=True)
    except Exception:  # broad: stderr may be closed; a warning never raises
        pass


def _on(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def announce(message: str, rank: int = 0) -> None:
    """Where to attach: the one line a job prints by default (rank 0's; every rank's with
    TORCHTOP_VERBOSE=1; none with TORCHTOP_QUIET)."""
    if not _on("TORCHTOP_QUIET") and (rank == 0 or _on("TORCHTOP_VERBOSE")):
        warn(message)


def notice(message: str) -> None:
    """What the agent is about to do (a one-off measurement, a sync check): said only when the
    user asked for it (TORCHTOP_VERBOSE=1), never with TORCHTOP_QUIET. Problems always use `warn`."""
    if _on("TORCHTOP_VERBOSE") and not _on("TORCHTOP_QUIET"):
        warn(message)


def ignore_warning(message: str = "", module: str = "") -> Callable[[], None]:
    """Ignore the warnings matching `message` (and `module`), process-wide, until the returned
    function is called; it removes that one filter entry and no other.

    `warnings.catch_warnings()` is not an option off the main thread: it swaps the process-wide
    filter list, so another thread's filters (the user's) could be lost when it restores it.
    """
    import re

    warnings.filterwarnings("ignore", message=message, module=module)
    # the entry as filterwarnings stores it (patterns compare equal by text and flags)
    entry = (
        "ignore",
        re.compile(message, re.I) if message else None,
        Warning,
        re.compile(module) if module else None,
        0,
    )
    if entry not in warnings.filters:  # a Python that stores filters otherwise: the one just added
        entry = warnings.filters[0]

    def remove() -> None:
        try:
            # a list (typeshed says Sequence); equal entries do the same: which one goes is moot
            cast("list[Any]", warnings.filters).remove(entry)
        except ValueError:
            return
        mutated = getattr(warnings, "_filters_mutated", None)
        if mutated is not None:  # drop the registries' cached decisions, as filterwarnings does
            mutated()

    return remove
