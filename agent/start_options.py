"""start()'s options, held once: the arguments the caller gave (also kept for a spawned child's
deferred start) and their defaults from the environment, read when the agent is built."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from torchtop.agent.warn import warn

if TYPE_CHECKING:
    from torchtop.agent.loop.recorder import Recorder


def env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


@dataclass(frozen=True)
class StartOptions:
    """The arguments of `torchtop.agent.start()`; its docstring says what each one means."""

    port: int | None = None
    bind: str | None = None
    auto: bool = True
    phase_every: int | None = None
    record: str | os.PathLike[str] | None = None
    peak_tflops: float | None = None
    flops_per_step: float | None = None
    publish_when_active: bool = False
    memory_limit: int | str | None = None  # bytes or "12GiB"; resolved: int bytes, 0 none
    oom_snapshot_at: float | None = None  # share of the limit; resolved: 0.0 none

    def resolved(self) -> StartOptions:
        """These options with the environment's defaults: $TORCHTOP_PORT, $TORCHTOP_BIND,
        $TORCHTOP_PHASE_EVERY, $TORCHTOP_MEMORY_LIMIT and $TORCHTOP_OOM_SNAPSHOT_AT where the
        caller gave none ($TORCHTOP_RECORD: `recorder`); a limit or share that does not parse is
        said once and left out."""
        port = self.port
        env_port = os.environ.get("TORCHTOP_PORT", "").strip()
        if port is None and env_port.isdigit():
            port = int(env_port)
        bind = self.bind or os.environ.get("TORCHTOP_BIND") or None
        phase_every = self.phase_every
        if phase_every is None:
            phase_every = env_int("TORCHTOP_PHASE_EVERY", 0)
        from torchtop.agent.capture.oom_snapshot import parse_fraction
        from torchtop.agent.telemetry.memory_limit import parse_size

        limit = self.memory_limit
        if limit is None:
            limit = os.environ.get("TORCHTOP_MEMORY_LIMIT", "").strip() or None
        limit_bytes = parse_size(limit) if limit not in (None, 0) else 0  # 0: resolved, none
        if limit_bytes is None:
            warn(f"memory limit {str(limit)[:40]!r} is not a size (bytes, or like 12GiB): ignored")
        at = self.oom_snapshot_at
        if at is None:
            at = os.environ.get("TORCHTOP_OOM_SNAPSHOT_AT", "").strip() or None
        fraction = parse_fraction(at) if at not in (None, 0) else 0.0
        if fraction is None:
            warn(f"oom snapshot share {str(at)[:40]!r} is not in (0, 1]: no automatic snapshot")
        return replace(
            self,
            port=port,
            bind=bind,
            phase_every=phase_every,
            memory_limit=limit_bytes or 0,
            oom_snapshot_at=fraction or 0.0,
        )


def recorder(record: str | os.PathLike[str] | None, rank: int | None) -> Recorder | None:
    """The recorder thread (not started) for `record` or $TORCHTOP_RECORD; None when neither
    asks for one or the directory cannot be written (said once: training goes on). `rank` None:
    no launcher named it; the recorder holds its batches until the agent settles it."""
    record = record or os.environ.get("TORCHTOP_RECORD") or None
    if record is None:
        return None
    from torchtop.agent.loop.recorder import Recorder
    from torchtop.contract.recording_store import DEFAULT_MAX_BYTES

    max_mb = env_int("TORCHTOP_RECORD_MB", 0)
    try:
        return Recorder(Path(record), rank, max_mb << 20 if max_mb > 0 else DEFAULT_MAX_BYTES)
    except OSError as exc:
        warn(f"cannot record to {record} ({exc.strerror or exc}); training goes on without a recording")
        return None
