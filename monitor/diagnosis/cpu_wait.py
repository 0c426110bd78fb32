"""A slow rank whose training thread waits for a CPU: its host is oversubscribed.

On a node whose cores other processes also want (more ranks or DataLoader workers than cores,
another job, torch's intra-op threads on every rank), a rank can be slow because its training
thread sits runnable in the kernel's run queue, not because of its work. The agent reads that
delay once a second (`HostSample.train_wait_percent`, Linux schedstat); here the straggler's
share of the window is set against the other ranks': where it waited `cpu_starved` percent and
twice their median, the verdict says so and its advice is about the host first. Pure functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from statistics import median

from torchtop.monitor.diagnosis.facts import THRESHOLDS as T
from torchtop.monitor.model.state import RunState, recent_points

ADVICE = (
    "give its process cores of its own: fewer DataLoader workers or torch threads "
    "(torch.set_num_threads) per rank, fewer ranks per node, or nothing else running there"
)


def cpu_waits(states: Mapping[int, RunState], seconds: float) -> dict[int, float]:
    """Each rank's mean percent of the last `seconds` its training thread waited for a CPU,
    where its agent says (Linux)."""
    out: dict[int, float] = {}
    for rank, state in states.items():
        waits = [p.cpu_wait for p in recent_points(state, seconds) if p.cpu_wait is not None]
        if waits:
            out[rank] = sum(waits) / len(waits)
    return out


def starved_line(rank: int, waits: Mapping[int, float]) -> str | None:
    """The evidence line where `rank` waited for a CPU far more than the others; else None."""
    own = waits.get(rank)
    others = [w for r, w in waits.items() if r != rank]
    if own is None or not others:
        return None
    typical = median(others)
    if own < T.cpu_starved or own < 2 * typical:
        return None
    return (
        f"rank {rank}'s training thread waited for a CPU {own:.0f}% of the time (the other ranks "
        f"{typical:.0f}%): its host is oversubscribed, not its work"
    )
