"""The job view at 1,024 ranks (128 nodes' relays, synthetic summaries) on a 120x40 screen: the
verdict names the straggler, coverage names the silent node, and the slowest ranks come first,
all in the first screenful."""

from __future__ import annotations

import pytest

from tests.rank_util import JOB, T0, hello, rank_steps
from torchtop.contract import wire
from torchtop.monitor.model.relayed import apply_summary
from torchtop.monitor.relay.summary import RankSummarizer
from torchtop.monitor.tui.job_app import JobApp

pytestmark = pytest.mark.slow
NODES, PER_NODE, SLOW = 128, 8, 777


async def test_a_1024_rank_job_on_one_screen() -> None:
    now = [100.0]
    app = JobApp(None, feed=False, clock=lambda: now[0])
    base = {}
    for slow in (False, True):
        steps = rank_steps(0, n=100, step_ms=100.0, data=40.0 if slow else 1.0)
        s = RankSummarizer(0)
        s.stats.add(steps)
        base[slow] = s.summary(0.0).buckets  # the same buckets for every rank but the slow one
    for n in range(NODES):
        ranks = []
        for k in range(PER_NODE):
            r = n * PER_NODE + k
            h = hello(r, world=NODES * PER_NODE, host=f"node{n:03d}", job_id=JOB)
            ranks.append(wire.RankSummary(rank=r, run_id=h.run_id, age=0.1, hello=h, buckets=base[r == SLOW]))
        summary = wire.NodeSummary(
            v=wire.PROTOCOL_VERSION, job_id=JOB, node=f"node{n:03d}", seq=1, time=T0 + 10, ranks=ranks
        )
        apply_summary(app.job, f"relay{n}", summary, 80.0 if n == 17 else 100.0)  # node 17 silent 20 s
    async with app.run_test(size=(120, 40)) as pilot:
        app.refresh_panels()
        await pilot.pause(0.5)
        head = app.ranks_panel.plain().splitlines()[:25]
    text = "\n".join(head)
    assert f"● rank {SLOW}: data wait" in text, text
    assert "◆ 1,016 of 1,024 ranks reporting; node017 silent 20 s" in text, text
    slowest = head.index(next(line for line in head if line.startswith("slowest")))
    assert head[slowest + 1].split()[0] == str(SLOW), text
