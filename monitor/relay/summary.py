"""One rank's summary as its node's relay keeps it: the rank's batches in, a RankSummary out.

The relay replays each rank's log (as a monitor does) into the rank's 1-second buckets
(model/rank_stats.py) and sends, once or twice a second, the seconds since its previous
summary: closed ones with their final sums, the open one as it stands. The monitor puts them
into its own RankStats for that rank, so the Ranks tab, the strip, the straggler rule and
coverage read the same figures as with a direct connection. Pure: no zmq.
"""

from __future__ import annotations

import msgspec

from torchtop.contract import wire
from torchtop.monitor.model.log_replay import LogReplay
from torchtop.monitor.model.rank_stats import RankStats

HELLO_EVERY_S = 5.0  # a rank's hello rides along this often (and whenever it changes)


def slim(tel: wire.Telemetry) -> wire.Telemetry:
    """The samples the job view reads: no fragmentation detail, no workers, no per-core figures."""
    host = tel.host
    if host is not None:
        host = msgspec.structs.replace(host, workers=[], cpu_per_core=[])
    return msgspec.structs.replace(tel, frag=[], host=host)


class RankSummarizer:
    """One rank of the relay's node."""

    def __init__(self, rank: int = -1) -> None:
        self.rank = rank
        self.run_id = ""
        self.hello: wire.Hello | None = None
        self.replay = LogReplay()
        self.stats = RankStats()
        self.seq = -1
        self.batches = 0
        self.steps = 0
        self.last_i = -1
        self.last_batch: float | None = None  # the relay's monotonic clock
        self.telemetry: wire.Telemetry | None = None
        self.gone = False
        self._sent_t = -1  # buckets from this second on go in the next summary
        self._hello_due = 0.0
        self._hello_sent: wire.Hello | None = None

    def set_hello(self, hello: wire.Hello) -> None:
        if self.run_id and hello.run_id != self.run_id:
            self._new_run()
        self.hello, self.run_id, self.rank, self.gone = hello, hello.run_id, hello.rank, False

    def resend_hello(self) -> None:
        self._hello_due = 0.0

    def _new_run(self) -> None:
        self.replay, self.stats, self.seq, self._sent_t = LogReplay(), RankStats(), -1, -1

    def add_batch(self, batch: wire.Batch, now: float) -> int:
        """A batch of the rank's stream; the train steps it completed."""
        if self.run_id and batch.run_id != self.run_id:
            self._new_run()
            self.hello = None  # another run on this socket: its hello is asked again
        self.run_id = batch.run_id
        if batch.run_id != self.replay.run_id:
            self.replay = LogReplay(batch.run_id)
        steps = [s for s in self.replay.feed(batch.log, batch.wall_offset, batch.rank) if s.kind == "train"]
        self.stats.add(steps)
        self.seq, self.last_batch, self.gone = batch.seq, now, False
        self.batches += 1
        self.steps += len(steps)
        if steps:
            self.last_i = max(self.last_i, steps[-1].i)
        if batch.telemetry is not None:
            self.telemetry = batch.telemetry
        if self.rank < 0:
            self.rank = batch.rank
        return len(steps)

    def summary(self, now: float) -> wire.RankSummary:
        """What changed since the previous summary (the open second again, as it stands now)."""
        secs = self.stats.levels[0]
        buckets = [b.second() for b in secs if b.t >= self._sent_t]
        if secs:
            self._sent_t = secs[-1].t
        hello = None
        if self.hello is not None and (self.hello is not self._hello_sent or now >= self._hello_due):
            hello, self._hello_sent, self._hello_due = self.hello, self.hello, now + HELLO_EVERY_S
        tel, self.telemetry = self.telemetry, None  # each sample once: the monitor keeps the latest
        return wire.RankSummary(
            rank=self.rank,
            run_id=self.run_id,
            seq=self.seq,
            age=now - self.last_batch if self.last_batch is not None else -1.0,
            gone=self.gone,
            batches=self.batches,
            steps=self.steps,
            last_i=self.last_i,
            hello=hello,
            buckets=buckets,
            telemetry=slim(tel) if tel is not None else None,
        )
