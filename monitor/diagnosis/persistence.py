"""Whether the straggler is chronic or a one-off: how often it was the slowest rank lately.

From the ranks' 10-second buckets (model/rank_stats.py): in each of the last SPANS spans, which
rank had the most time of its own a step. A straggler that was the slowest in most of them is
chronic (a slow node, a bad card, a skewed shard); one that was not is a one-off (a hiccup, a
checkpoint, a neighbour's job). Pure.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from torchtop.monitor.model.job_state import JobState

SPANS = 6  # the last minute, in 10 s spans
CHRONIC_SHARE = 0.6  # slowest in at least this share of the spans seen
MIN_SPANS = 3

Kind = Literal["chronic", "one-off"]


class Persistence(NamedTuple):
    kind: Kind | None  # None: too few spans to say
    slowest_in: int  # spans in which the rank was the slowest
    spans: int  # spans seen

    def text(self, rank: int) -> str:
        if self.kind is None:
            return ""
        return f"rank {rank} was the slowest in {self.slowest_in} of the last {self.spans} 10 s spans: {self.kind}"


def persistence(job: JobState, rank: int, spans: int = SPANS) -> Persistence:
    best: dict[int, tuple[float, int]] = {}  # span start -> (most own ms, its rank)
    for m in job.live():
        for t, busy in m.stats.busy_spans(spans, 10):  # closed spans only: the open one is partial
            if busy is not None and (t not in best or busy > best[t][0]):
                best[t] = (busy, m.rank)
    recent = sorted(best)[-spans:]
    if len(recent) < MIN_SPANS:
        return Persistence(None, 0, len(recent))
    hits = sum(best[t][1] == rank for t in recent)
    return Persistence("chronic" if hits >= CHRONIC_SHARE * len(recent) else "one-off", hits, len(recent))
