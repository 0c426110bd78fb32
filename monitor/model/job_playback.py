"""A job's recording (PATH/rank0, PATH/rank1, ...) read back as the job view received it live:
every rank's messages merged in time order into one JobState, so `report` on it is the job
report and `replay` shows the job view, with the job's verdict. Pure (files; no zmq, no textual).
"""

from __future__ import annotations

from bisect import bisect_right
from pathlib import Path

from torchtop.contract import wire
from torchtop.contract.recording_reader import read_rank
from torchtop.monitor.model.job_state import JobState
from torchtop.monitor.model.log_replay import LogReplay
from torchtop.monitor.model.playback import Playback


def rank_key(rank: int) -> str:
    """The member key a recorded rank gets (a live job keys members by endpoint)."""
    return f"rank{rank}"


class JobPlayback:
    """Every rank's Playback and their messages in one time order: (time, rank, index)."""

    def __init__(self, ranks: dict[int, Path]) -> None:
        self.ranks = {r: Playback(read_rank(path)) for r, path in sorted(ranks.items())}
        order = sorted(
            (t, r, k) for r, pb in self.ranks.items() for k, t in enumerate(pb.times)
        )  # a rank's messages keep their order: its times never go back
        self.order = [(r, k) for _, r, k in order]
        self.times = [t for t, _, _ in order]
        self.warnings = [w for pb in self.ranks.values() for w in pb.warnings]
        first = self.ranks[min(self.ranks)]
        self.directory = first.recording.directory.parent
        self.job_id = next(
            (pb.hello.job_id for pb in self.ranks.values() if pb.hello and pb.hello.job_id), ""
        )

    @property
    def start(self) -> float:
        return self.times[0] if self.times else 0.0

    @property
    def end(self) -> float:
        return self.times[-1] if self.times else 0.0

    def index_at(self, t: float) -> int:
        return bisect_right(self.times, t)

    def new_job(self) -> JobState:
        return JobState(self.job_id)

    def apply(self, job: JobState, lo: int, hi: int, replays: dict[int, LogReplay]) -> None:
        """Feed merged messages [lo, hi) into `job`, each rank's log through its own replay."""
        for r, k in self.order[lo:hi]:
            pb = self.ranks[r]
            played = next(pb.play(k, k + 1, replays.setdefault(r, LogReplay())), None)
            if played is None:
                continue
            key = rank_key(r)
            if isinstance(played.msg, wire.Hello):
                job.apply_hello(key, played.msg)
            else:
                job.apply_batch(
                    key, played.msg, played.steps, played.msg.time, played.log_errors, finish=False
                )
        job.finish()

    def job_until(self, t: float | None = None) -> JobState:
        """The job as a monitor attached all along held it at time `t` (default: the end)."""
        job = self.new_job()
        self.apply(job, 0, len(self.order) if t is None else self.index_at(t), {})
        return job
