"""Synthetic recordings with known steps, for the format, replay, compare and export tests."""

from __future__ import annotations

from pathlib import Path

from torchtop.contract import logcodes, wire
from torchtop.contract import recording_store as store

V = wire.PROTOCOL_VERSION
T0 = 1_800_000_000.0
BATCH_S = 0.1  # ten batches a second, as the agent publishes while watched


def hello(run_id: str = "run-a", rank: int = 0, host: str = "h") -> wire.Hello:
    return wire.Hello(
        v=V,
        run_id=run_id,
        pid=42 + rank,
        host=host,
        port=1,
        pub_port=2,
        device="cpu",
        start_time=T0,
        rank=rank,
    )


def batch(
    k: int, steps_per_chunk: int = 10, run_id: str = "run-a", rank: int = 0, data_share: float = 0.0
) -> wire.Batch:
    """Batch k: one chunk of `steps_per_chunk` whole steps filling its 0.1 s (pairs, as a CPU
    agent ships them): forward 30% of each step, the data wait `data_share` of it."""
    step_ns = int(BATCH_S * 1e9) // steps_per_chunk
    base = int(1e9) + k * steps_per_chunk * step_ns
    items: list[logcodes.Item] = []
    for s in range(steps_per_chunk):
        t = base + s * step_ns
        d = int(step_ns * data_share)
        if d:
            items += [t + 1, logcodes.DATA, t + d, logcodes.EXIT | logcodes.DATA]
        items += [t + d + 1, logcodes.FORWARD, t + d + int(step_ns * 0.3), logcodes.EXIT | logcodes.FORWARD]
        items += [t + step_ns, logcodes.BOUNDARY]
    chunk = wire.LogChunk(k, (k + 1) * steps_per_chunk, items, True)
    time = T0 + k * BATCH_S
    # steps on the batches' clock: the log's 1.0 s is T0
    return wire.Batch(
        v=V,
        run_id=run_id,
        seq=k,
        time=time,
        log=[chunk],
        telemetry=wire.Telemetry(time=time),
        rank=rank,
        wall_offset=T0 - 1.0 - BATCH_S,  # the last step of batch k ends at its time
    )


def write(path: Path, n: int, max_bytes: int = store.DEFAULT_MAX_BYTES, rank: int = 0, **kw: object) -> None:
    w = store.RecordingWriter(path, rank, max_bytes)
    w.write(hello(rank=rank))
    for k in range(n):
        w.write(batch(k, rank=rank, **kw))  # type: ignore[arg-type]
    w.close()
