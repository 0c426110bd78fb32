"""The automatic memory snapshot before an out-of-memory: once memory passes the share of its
limit the user set (TORCHTOP_OOM_SNAPSHOT_AT=0.9, start(oom_snapshot_at=)), the agent takes one
CUDA memory snapshot through the ordinary capture (controller.py: its file stays on disk for
after the OOM). Checked on the agent thread at each memory sample (collector.fast); on CPU
there is no CUDA snapshot, said once. Never raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torchtop.agent.warn import warn
from torchtop.contract.request_commands import Command
from torchtop.contract.telemetry import MemorySample

SNAPSHOT_STEPS = 1  # allocation history over one step: short, so the OOM rarely comes first
MAX_TRIES = 20  # a capture already running refuses it: tried again at later samples, then given up


def parse_fraction(text: str | float | None) -> float | None:
    """A share of the limit in (0, 1]; None when not one."""
    if text is None or isinstance(text, bool):
        return None
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if 0.0 < value <= 1.0 else None


def cuda_use(memory: list[MemorySample], user: int) -> tuple[int, int]:
    """(memory held, its limit) on the first device: reserved by the caching allocator (what an
    allocation that does not fit needs more of) against the device's share, or the user's limit."""
    if not memory:
        return 0, 0
    m = memory[0]
    limits = [x for x in (m.device_total, user) if x > 0]
    return max(m.reserved, m.allocated), min(limits) if limits else 0


class OomSnapshot:
    """One snapshot a run, at `fraction` of the limit. `request` is the capture controller's
    (agent thread); `say`: a line to the user (stderr)."""

    def __init__(
        self,
        fraction: float,
        request: Callable[[str, dict[str, Any]], Any],
        say: Callable[[str], None] = warn,
    ) -> None:
        self.fraction = fraction
        self.request = request
        self.say = say
        self.done = False
        self.tries = 0
        self.reason = ""  # why no snapshot was taken, for telemetry's `unavailable` ("": none)

    def check(self, used: int, limit: int, cuda: bool) -> None:
        if self.done or limit <= 0 or used < self.fraction * limit:
            return
        share = f"{used / limit:.0%} of its {limit / 2**30:.2f} GiB limit"
        if not cuda:
            self.done = True
            self.reason = "no CUDA memory snapshot on CPU"
            self.say(f"memory passed {share}; no CUDA memory snapshot on CPU (snapshots are CUDA's)")
            return
        self.tries += 1
        try:
            info = self.request(Command.CAPTURE_MEMORY, {"steps": SNAPSHOT_STEPS})
        except Exception as exc:  # broad: a refused capture (another running) is tried again, never raised
            if self.tries >= MAX_TRIES:
                self.done = True
                self.reason = f"automatic memory snapshot not taken: {exc}"[:200]
                self.say(self.reason)
            return
        self.done = True
        cid = getattr(info, "id", "")
        self.say(
            f"memory passed {share}: memory snapshot {cid} is being taken; its file stays for after an OOM"
        )
