"""The job view's cost at many ranks is paid once per rank, not several times: a refresh reads
each rank's window once and each closed 10 s span once, the Ranks panel makes the lines on screen
(not a line per rank), the relay reader tries only the sockets that hold frames, a refresh's
budget is its CPU time, and a rank's buckets are little work for the garbage collector. Counts and
ratios, never times (the 1,024-rank figures: tests/benchmarks/bench_relays.py, docs/benchmarks.md)."""

from __future__ import annotations

import gc
import random
import time
from collections import deque
from pathlib import Path

import pytest

from tests.benchmarks.bench_relays import _bucket
from tests.rank_util import JOB, T0, hello, rank_steps
from torchtop.contract import wire
from torchtop.monitor.model import rank_stats
from torchtop.monitor.model.rank_stats import SIZE, RankStats
from torchtop.monitor.model.relayed import apply_summary
from torchtop.monitor.tui.app import MAX_CPU_SHARE
from torchtop.monitor.tui.job_app import JobApp
from torchtop.monitor.tui.widgets import ranks_panel

PER_NODE, SLOW = 8, 13


def _job_app(nodes: int, seconds: int = 40) -> tuple[JobApp, list[float]]:
    """A job view over `nodes` relays of 8 ranks, `seconds` of 1-second buckets each (rank SLOW
    slow in its data wait), fed without a feed: the clock is the test's."""
    now = [1000.0]
    app = JobApp(None, feed=False, clock=lambda: now[0])
    world = nodes * PER_NODE
    for k in range(seconds):
        now[0] = 1000.0 + k
        second = int(T0) + k
        for n in range(nodes):
            ranks = [
                wire.RankSummary(
                    rank=r, run_id=f"run{r}", age=0.1, batches=k, last_i=200 * k,
                    hello=hello(r, world=world, host=f"node{n:03d}", job_id=JOB) if k == 0 else None,
                    buckets=[_bucket(second, 200, 5.0, 33, r == SLOW)],
                )
                for r in range(n * PER_NODE, (n + 1) * PER_NODE)
            ]  # fmt: skip
            summary = wire.NodeSummary(
                v=wire.PROTOCOL_VERSION,
                job_id=JOB,
                node=f"node{n:03d}",
                seq=k,
                time=second + 0.9,
                ranks=ranks,
            )
            apply_summary(app.job, f"relay{n}", summary, now[0])
    return app, now


def _counting(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[int]:
    calls = [0]
    real = getattr(module, name)

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


# -- a rank's buckets ---------------------------------------------------------------------------
def test_kept_figures_are_the_buckets_figures() -> None:
    """A window read twice and a closed span's own time, kept, equal the figures summed afresh
    (series(), window()), as seconds arrive with gaps, over 10 s and 5 min spans."""
    rng = random.Random(7)
    for _ in range(40):
        stats = RankStats()
        t = int(T0) + rng.randrange(600)
        for _ in range(rng.randrange(1, 700)):
            t += rng.choice([0, 1, 1, 1, 2, 9, 31, 301])
            values = [float(rng.randrange(50)) for _ in range(SIZE)]
            values[rank_stats.N] = float(rng.randrange(1, 200))
            stats.put(t, values)
            for width, bucket_s in ((24, 10), (7, 10), (12, 300)):
                want = [(ts, rt.busy_ms if rt.steps else None) for ts, rt in stats.series(width, bucket_s)]
                assert stats.busy_series(width, bucket_s) == want
                assert stats.busy_spans(width - 1, bucket_s) == want[:-1]  # persistence.py's closed spans
            assert stats.window(10.0) == stats.window(10.0) == stats._window(10.0, None)


def test_a_ranks_buckets_are_little_work_for_the_collector() -> None:
    """A day of 1,024 ranks' buckets is 786k buckets: their figures are no objects of their own
    for each full collection to visit (a list of 19 floats was 19 of them, a cache miss each)."""
    relayed, direct = RankStats(), RankStats()
    relayed.put(int(T0), [1.0] * SIZE)
    relayed.put(int(T0) + 11, [2.0] * SIZE)
    direct.add(rank_steps(0, n=300, step_ms=50.0))
    buckets = [b for s in (relayed, direct) for level in s.levels for b in level]
    assert len(buckets) >= 6
    assert all(len(gc.get_referents(b.v)) <= 1 for b in buckets)  # at most its type


# -- a refresh --------------------------------------------------------------------------------
@pytest.mark.slow  # 256 ranks' 40 s of buckets, a headless app
async def test_a_refresh_reads_each_rank_about_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank's 10 s window is read by the verdict, the head lines and the table: summed once;
    its closed spans (strip, persistence) once each; only the changed figures are recomputed."""
    app, now = _job_app(nodes=32)
    ranks = len(app.job.ranked())
    async with app.run_test(size=(120, 40)) as pilot:
        app.refresh_panels()
        await pilot.pause(0.1)
        assert app.straggler is not None and app.straggler.rank == SLOW
        calls = _counting(monkeypatch, rank_stats, "times_of")
        second = int(T0) + 40  # a new second for every rank: every window changes
        for n in range(32):
            ranks_ = [
                wire.RankSummary(
                    rank=r, run_id=f"run{r}", age=0.1, buckets=[_bucket(second, 200, 5.0, 33, r == SLOW)]
                )
                for r in range(n * PER_NODE, (n + 1) * PER_NODE)
            ]
            s = wire.NodeSummary(
                v=wire.PROTOCOL_VERSION,
                job_id=JOB,
                node=f"node{n:03d}",
                seq=40,
                time=second + 0.9,
                ranks=ranks_,
            )
            now[0] += 1.0
            apply_summary(app.job, f"relay{n}", s, now[0])
        app.refresh_panels()
        await pilot.pause(0.1)
    assert app.straggler is not None and app.straggler.rank == SLOW
    # per rank: its window and its strip's open span; then the straggler's rivals' seconds (32
    # ranks' 10 s): the same figures summed 3 times over and every span afresh was ~14 a rank
    assert calls[0] < 6 * ranks, (calls[0], ranks)


@pytest.mark.slow  # 256 ranks, a headless app
async def test_the_ranks_panel_makes_the_lines_on_screen(monkeypatch: pytest.MonkeyPatch) -> None:
    """The table is a line per rank, the screen shows some 30: a refresh makes those (a scroll
    makes the others as they show), each drawn as the whole panel's text draws it."""
    from textual.widget import Widget

    app, _ = _job_app(nodes=32)
    async with app.run_test(size=(120, 40)) as pilot:
        calls = _counting(monkeypatch, ranks_panel, "_cells")
        app.refresh_panels()
        await pilot.pause(0.2)
        panel = app.ranks_panel
        made = calls[0]
        lines = len(panel._layout.keys)
        shown = [type(panel).render_line(panel, y) for y in range(45)]
        panel._dirty_regions.add(panel.region)  # the whole text, rendered as Textual renders it
        whole = [Widget.render_line(panel, y) for y in range(45)]
        text = panel.plain()
    assert lines > 256 and made < 60, (made, lines)  # it was 2 a line: every rank, twice
    assert [list(s) for s in shown] == [list(s) for s in whole]  # the same cells, colours, offsets
    assert all(f"\n{r:>6} node{r // PER_NODE:03d}" in text for r in range(256))  # every rank's line
    assert f"● rank {SLOW}: data wait" in text


def test_a_refresh_is_budgeted_by_its_cpu_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The next full refresh waits for the refresh's CPU time / MAX_CPU_SHARE: a busy machine's
    wait for a core (wall time, no CPU) does not put the panels off too."""
    app = JobApp(None, feed=False)
    waited = 0.2
    monkeypatch.setattr(app, "refresh_panels", lambda: time.sleep(waited))  # wall time, no CPU
    app._dirty = True
    before = time.perf_counter()
    app._tick()
    assert app._next_full - before < 0.5 * waited / MAX_CPU_SHARE  # by the wall time: >= 4 s


# -- the relays' sockets ------------------------------------------------------------------------
def test_the_relay_reader_tries_only_the_sockets_that_hold_frames(tmp_path: Path) -> None:
    """128 nodes' 256 sockets each tried 10 times a second cost ~3% of a core (zmq.Again):
    a read polls them once and takes frames only where some wait."""
    import zmq

    from torchtop.monitor.link.job_link import Event
    from torchtop.monitor.link.relay_link import RelayReader
    from torchtop.monitor.link.targets import Endpoint

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"ipc://{tmp_path}/live.pub")
    silent = [
        Endpoint(f"ipc://{tmp_path}/s{k}.req", f"ipc://{tmp_path}/s{k}.pub", None, f"s{k}") for k in range(16)
    ]
    live = Endpoint(f"ipc://{tmp_path}/live.req", f"ipc://{tmp_path}/live.pub", None, "live")
    reader = RelayReader([*silent, live], ctx=ctx)
    tried: deque[str] = deque()
    for name, r in reader.relays.items():
        for sock, method in ((r.sub, "recv_multipart"), (r.dealer, "recv")):
            real = getattr(sock, method)
            setattr(
                sock,
                method,
                lambda *a, _real=real, _name=name, **kw: (tried.append(_name), _real(*a, **kw))[1],
            )
    frame = wire.encode(
        wire.NodeSummary(v=wire.PROTOCOL_VERSION, job_id=JOB, node="live", seq=1, time=T0, ranks=[])
    )
    try:
        got: list[Event] = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(e.kind == "summary" for e in got):
            pub.send_multipart([b"S", frame])  # until the subscription has reached the PUB
            time.sleep(0.05)
            got += reader.read(time.monotonic(), Event)
        assert any(e.kind == "summary" and e.key == str(live) for e in got)
        assert tried and set(tried) == {str(live)}  # the silent relays' sockets: never tried
    finally:
        reader.close()
        pub.close(linger=0)
        ctx.term()
