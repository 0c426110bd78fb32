"""The allocation sites that grew during a memory capture: live bytes by site at its midpoint step
(a first snapshot, taken on its own thread and reduced at once to a small dict) against its last.

A snapshot is taken while the next step runs, so its live blocks include that step's activations;
each is cut back to the step boundary it follows with the allocator trace's epoch timestamps
(blocks allocated after it left out, blocks freed since put back), so a step's transient tensors
never read as growth. Pure but for `Midpoint`'s thread and `record_history`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from torchtop.agent.capture.memory_summary import site_of

MIB = 2**20
MAX_ENTRIES = 200_000  # allocator trace entries kept: the file and the snapshot's time stay bounded
MAX_SITES = 4096  # sites kept from the first snapshot: its largest (a dropped one reads as all growth)
FLOOR = MIB  # less growth than this over the whole span is noise (a cached batch, a buffer)
LISTED = 10
SITE_CHARS = 300
JOIN_S = 60.0  # the last snapshot waits this long for the first's


def record_history(memory: Any) -> None:
    """Allocator history on, with Python-only stacks where the torch takes them (2.1+: C++ frames
    are most of a trace entry's cost); the torch's default stacks otherwise, silently."""
    try:
        memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")
    except TypeError:  # a torch without `stacks`
        memory._record_memory_history(max_entries=MAX_ENTRIES)


def live_by_site(snapshot: dict[str, Any], cut: float | None = None) -> dict[str, int]:
    """Bytes allocated and not freed, by site (memory_summary.site_of), at `cut` (time.time()
    seconds; None: when the snapshot was taken). Trace entries without a time leave it uncut."""
    totals: dict[str, int] = {}
    late = _cut_back(snapshot, cut * 1e6, totals) if cut is not None else set[int]()
    for segment in snapshot.get("segments") or []:
        address = segment.get("address")
        for block in segment.get("blocks") or []:
            addr = block.get("address", address)
            if isinstance(address, int):
                address += _int(block.get("size"))
            if block.get("state") != "active_allocated" or addr in late:
                continue
            site = site_of(block.get("frames") or [])
            totals[site] = totals.get(site, 0) + _int(block.get("size"))
    return totals


def _cut_back(snapshot: dict[str, Any], cut_us: float, totals: dict[str, int]) -> set[int]:
    """From the allocator trace (chronological, epoch microseconds): the addresses allocated after
    the cut, to leave out; the blocks live at it and freed since are added to `totals`."""
    late: set[int] = set()
    born: dict[int, dict[str, Any]] = {}  # address -> its alloc entry, allocated by the cut
    for trace in snapshot.get("device_traces") or []:
        for entry in trace or []:
            action, addr, at = entry.get("action"), entry.get("addr"), entry.get("time_us")
            if not isinstance(addr, int) or not isinstance(at, (int, float)):
                continue
            after = at > cut_us
            if action == "alloc":
                if after:
                    late.add(addr)
                else:
                    born[addr] = entry
            elif action == "free_requested":
                if not after:
                    born.pop(addr, None)
                elif addr in late:
                    late.discard(addr)  # allocated and freed after the cut: never live at it
                elif addr in born:  # live at the cut, freed since: put back
                    freed = born.pop(addr)
                    site = site_of(freed.get("frames") or [])
                    totals[site] = totals.get(site, 0) + _int(freed.get("size"))
    return late


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def growing_sites(
    first: dict[str, int], last: dict[str, int], steps: int, n: int = LISTED, floor: int = FLOOR
) -> list[dict[str, Any]]:
    """The sites whose live bytes grew by `floor` or more between the two, most first, with the
    growth a step over the `steps` between them: [{"site", "bytes", "per_step"}]."""
    grown = [(site, after - first.get(site, 0)) for site, after in last.items()]
    ranked = sorted((g for g in grown if g[1] >= floor), key=lambda g: (-g[1], g[0]))[:n]
    return [
        {"site": site[:SITE_CHARS], "bytes": b, "per_step": round(b / steps) if steps > 0 else 0}
        for site, b in ranked
    ]


def _largest(sites: dict[str, int]) -> dict[str, int]:
    if len(sites) <= MAX_SITES:
        return sites
    return dict(sorted(sites.items(), key=lambda kv: kv[1], reverse=True)[:MAX_SITES])


class Midpoint:
    """A memory capture's first snapshot: started at its midpoint step boundary (`step`, ended at
    `at`, time.time()), taken and reduced on its own thread; only the site table is kept."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]], step: int, at: float) -> None:
        self.step, self.at = step, at
        self.sites: dict[str, int] | None = None
        self.error = ""
        self._thread = threading.Thread(
            target=self._take, args=(snapshot,), name="torchtop-capture", daemon=True
        )
        self._thread.start()

    def _take(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        try:
            self.sites = _largest(live_by_site(snapshot(), self.at))
        except Exception as exc:  # broad: a failed first snapshot leaves the capture, says why
            self.error = f"{type(exc).__name__}: {exc}"[:200]

    def wait(self, timeout: float = JOIN_S) -> None:
        """Before the last snapshot: the two never run at once."""
        self._thread.join(timeout)

    def summary(self, last: dict[str, Any], step: int, at: float) -> dict[str, Any]:
        """The growth fields of the capture's summary, against the last snapshot (its boundary:
        `step`, `at`): growing_sites and growth_steps, else growth_note (why not)."""
        if self.sites is None:
            return {"growth_note": f"the first snapshot failed: {self.error or 'not taken in time'}"}
        steps = step - self.step
        if steps <= 0:
            return {"growth_note": "no step ended between the two snapshots"}
        try:
            grown = growing_sites(self.sites, live_by_site(last, at), steps)
        except Exception as exc:  # broad: the capture's file and sites stand without its growth
            return {"growth_note": f"growth not measured: {type(exc).__name__}: {exc}"[:200]}
        return {"growing_sites": grown, "growth_steps": steps}
