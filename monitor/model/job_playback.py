"""A job's recording (PATH/rank0, PATH/rank1, ...) read back as the job view received it live:
every rank's messages merged in time order into one JobState, so `report` on it is the job
report and `replay` shows the job view, with the job's verdict. Pure (files; no zmq, no textual).

A rank that cannot be read (an empty, header-only or unreadable directory: a rank that died
before its first batch) is left out with a note; so is a second directory of one rank. Ranks of
different jobs, a rank recorded twice and a rank whose log yields no steps are noted too: said
in the job's notes and the command's warnings, never merged in silence.
"""

from __future__ import annotations

from bisect import bisect_right
from pathlib import Path

from torchtop.contract import wire
from torchtop.contract.recording import RecordingError
from torchtop.contract.recording_reader import rank_dirs, read_rank
from torchtop.monitor.model.job_state import JobState
from torchtop.monitor.model.log_replay import LogReplay
from torchtop.monitor.model.playback import Playback


def rank_key(rank: int) -> str:
    """The member key a recorded rank gets (a live job keys members by endpoint)."""
    return f"rank{rank}"


class JobPlayback:
    """Every rank's Playback and their messages in one time order: (time, rank, index)."""

    def __init__(self, ranks: dict[int, Path]) -> None:
        self.ranks: dict[int, Playback] = {}
        self.notes: list[str] = []  # about the job's ranks: also in every JobState it makes
        if ranks:
            self.notes += rank_dirs(next(iter(ranks.values())).parent)[1]
        for r, path in sorted(ranks.items()):
            try:
                self.ranks[r] = Playback(read_rank(path))
            except (RecordingError, OSError) as exc:  # a rank that died before its first batch
                self.notes.append(f"rank {r} left out: {exc}")
        if not self.ranks:
            raise RecordingError("no rank of the recording can be read: " + "; ".join(self.notes))
        self.notes += _odd_ranks(self.ranks)
        self.notes += [line for r, pb in self.ranks.items() if (line := pb.no_steps(f"rank {r}"))]
        order = sorted(
            (t, r, k) for r, pb in self.ranks.items() for k, t in enumerate(pb.times)
        )  # a rank's messages keep their order: its times never go back
        self.order = [(r, k) for _, r, k in order]
        self.times = [t for t, _, _ in order]
        self.warnings = [w for pb in self.ranks.values() for w in pb.warnings] + self.notes
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
        job = JobState(self.job_id)
        for line in self.notes:
            job.note(line)
        return job

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


def _odd_ranks(ranks: dict[int, Playback]) -> list[str]:
    """Lines for ranks of different jobs, and for one rank recorded in two directories."""
    out: list[str] = []
    jobs: dict[str, list[int]] = {}
    claimed: dict[int, list[int]] = {}
    for r, pb in ranks.items():
        hello = pb.hello
        if hello is None:
            continue
        if hello.job_id:
            jobs.setdefault(hello.job_id, []).append(r)
        claimed.setdefault(hello.rank, []).append(r)
    if len(jobs) > 1:
        each = "; ".join(f"job {j[:80]!r}: rank {', '.join(map(str, rs))}" for j, rs in jobs.items())
        out.append(
            f"ranks of {len(jobs)} jobs in one recording ({each}): record each job into its own directory"
        )
    for rank, dirs in claimed.items():
        if len(dirs) > 1:
            where = ", ".join(f"rank{d}/" for d in dirs)
            out.append(f"rank {rank} recorded twice ({where}): each is shown under its directory's rank")
    spans = sorted((pb.start, pb.end, r) for r, pb in ranks.items())
    reach = spans[0][1]
    for start, end, r in spans[1:]:
        if start > reach:  # ranks of one run overlap in time; these were recorded apart
            out.append(
                f"rank {r} was recorded {start - reach:.0f} s after the ranks before it ended: "
                "two runs in one directory? (record each run into its own)"
            )
        reach = max(reach, end)
    return out
