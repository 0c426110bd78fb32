"""`torchtop trace`: recordings (and a capture) to a Perfetto / Chrome JSON trace, a track per rank.

The trace processor (the `perfetto` package) loads it where its binary can be had ($PERFETTO_
TRACE_PROCESSOR, or the package's own download); without it, the JSON trace-event format is
checked strictly here: every event's fields and types, and slices that nest within their step.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from contextlib import redirect_stderr
from pathlib import Path
from typing import Any

import pytest

from tests.recording_util import T0, write
from torchtop.contract.logcodes import PHASES
from torchtop.monitor.commands.cli import main

PHASE_NAMES = set(PHASES)


def convert(*argv: str) -> tuple[int, str]:
    err = io.StringIO()
    with redirect_stderr(err):
        code = main(["trace", *argv])
    return code, err.getvalue()


def check_chrome_trace(trace: dict[str, Any]) -> dict[tuple[int, int], list[dict[str, Any]]]:
    """Strict checks of the JSON trace-event format (the subset written); the complete slices
    of each (pid, tid) track, in order."""
    assert isinstance(trace, dict) and isinstance(trace["traceEvents"], list)
    assert trace.get("displayTimeUnit") in ("ms", "ns")
    tracks: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    named: set[int] = set()
    for e in trace["traceEvents"]:
        assert isinstance(e, dict) and isinstance(e.get("ph"), str) and isinstance(e.get("name"), str), e
        assert isinstance(e.get("pid"), int) and e["pid"] > 0, e
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "process_sort_index", "thread_name"), e
            assert isinstance(e["args"], dict), e
            if e["name"] == "process_name":
                named.add(e["pid"])
        elif e["ph"] == "X":
            assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
            assert isinstance(e.get("tid"), int), e
            tracks[(e["pid"], e["tid"])].append(e)
        elif e["ph"] == "C":
            assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
            assert e["args"] and all(isinstance(v, (int, float)) for v in e["args"].values()), e
        else:
            raise AssertionError(f"unexpected event type {e['ph']!r}")
    for (pid, _), slices in tracks.items():
        assert pid in named, f"process {pid} has no name"
        step_end = None
        for s in slices:  # a step, then its phases inside it
            if s["cat"] in ("train", "eval"):
                step_end = s["ts"] + s["dur"]
            else:
                assert s["name"] in PHASE_NAMES and step_end is not None, s
                assert s["ts"] + s["dur"] <= step_end, s
    return tracks


def trace_processor(path: Path) -> Any:
    """The trace processor on `path`, or a skip when its binary cannot be had here."""
    tp_mod = pytest.importorskip("perfetto.trace_processor")
    config = tp_mod.TraceProcessorConfig(bin_path=os.environ.get("PERFETTO_TRACE_PROCESSOR"))
    try:
        return tp_mod.TraceProcessor(trace=str(path), config=config)
    except Exception as exc:  # the package downloads its binary; offline that fails
        pytest.skip(
            f"no trace processor binary here ({type(exc).__name__}); the JSON format is checked strictly instead"
        )


def two_ranks(tmp_path: Path) -> Path:
    job = tmp_path / "job"
    for rank in (0, 1):
        write(job, 50, rank=rank, data_share=0.2)  # 500 steps each
    return job


def test_a_job_recording_becomes_a_trace_with_a_track_per_rank(tmp_path: Path) -> None:
    out = tmp_path / "job.json"
    code, err = convert(str(two_ranks(tmp_path)), "-o", str(out))
    assert code == 0, err
    assert "2 ranks, 1000 steps" in err
    trace = json.loads(out.read_text())
    tracks = check_chrome_trace(trace)
    assert len(tracks) == 2  # one track (the steps thread) per rank
    for slices in tracks.values():
        steps = [s for s in slices if s["cat"] == "train"]
        assert [s["args"]["step"] for s in steps] == list(range(500))
        assert {s["name"] for s in slices if s["cat"] == "phase"} == {"data", "forward", "other"}
        assert steps[1]["dur"] == 10_000  # 10 ms steps, in microseconds
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {"rank 0 · h pid 42 · cpu", "rank 1 · h pid 43 · cpu"}


def test_a_capture_merges_into_its_ranks_process(tmp_path: Path) -> None:
    job = two_ranks(tmp_path)
    capture = {  # a torch.profiler trace of rank 1 (pid 43): times relative to baseTimeNanoseconds
        "baseTimeNanoseconds": int((T0 + 1.0) * 1e9),
        "host_name": "h",
        "traceEvents": [
            {"ph": "M", "name": "process_name", "pid": 43, "tid": 0, "args": {"name": "python"}},
            {
                "ph": "X",
                "name": "aten::mm",
                "cat": "cpu_op",
                "pid": 43,
                "tid": 4321,
                "ts": 500.0,
                "dur": 20.0,
            },
            {"ph": "X", "name": "gemm", "cat": "kernel", "pid": 0, "tid": 7, "ts": 510.0, "dur": 5.0},
        ],
    }
    path = tmp_path / "cap.pt.trace.json"
    path.write_text(json.dumps(capture))
    out = tmp_path / "merged.json"
    code, err = convert(str(job), "--capture", str(path), "-o", str(out))
    assert code == 0, err
    events = json.loads(out.read_text())["traceEvents"]
    mm = next(e for e in events if e["name"] == "aten::mm")
    rank1 = next(
        e["pid"] for e in events if e["name"] == "process_name" and e["args"]["name"].startswith("rank 1")
    )
    assert mm["pid"] == rank1  # the profiler's host events sit under rank 1's process
    first = min(e["ts"] for e in events if e.get("cat") == "train")
    # T0 + 1.0 s + 500 us on the recording's clock, where the first step started at T0 - 0.1 s
    assert mm["ts"] - first == pytest.approx(1.1005e6)
    kernel = next(e for e in events if e["name"] == "gemm")
    assert kernel["pid"] not in (1, 2)  # the device gets a process of its own


def test_trace_needs_an_input(tmp_path: Path) -> None:
    code, err = convert("-o", str(tmp_path / "x.json"))
    assert code == 2 and "give recordings" in err


def test_the_trace_processor_loads_it_with_a_track_per_rank(tmp_path: Path) -> None:
    out = tmp_path / "job.json"
    assert convert(str(two_ranks(tmp_path)), "-o", str(out))[0] == 0
    tp = trace_processor(out)
    rows = list(
        tp.query("select track_id, count(*) as n from slice where name like 'step %' group by track_id")
    )
    assert [r.n for r in rows] == [500, 500]


@pytest.mark.slow
def test_a_real_two_rank_job_recorded_and_traced(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    """Two real training processes (RANK 0 and 1 of WORLD_SIZE 2, as torchrun starts them)
    record into one directory; the trace has a track per rank with every recorded step."""
    script = tmp_path / "train.py"
    script.write_text(
        "import sys, time, torch\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})\n"
        "torch.set_num_threads(1)\n"
        "import torchtop.agent as ta\n"
        "from tests.agent_util import mlp, tensor_loader, train\n"
        "ta.start()\n"
        "model, end = mlp(), time.monotonic() + 6\n"
        "while time.monotonic() < end:\n"
        "    train(model, tensor_loader(20))\n"
        "ta.stop()\n"
    )
    env = dict(subprocess_env, TORCHTOP_RECORD=str(tmp_path / "job"), WORLD_SIZE="2")
    procs = [
        subprocess.Popen([sys.executable, str(script)], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
        for r in (0, 1)
    ]
    deadline = time.monotonic() + 120
    for p in procs:
        assert p.wait(max(1.0, deadline - time.monotonic())) == 0
    assert sorted(os.listdir(tmp_path / "job")) == ["rank0", "rank1"]
    out = tmp_path / "job.json.gz"
    code, err = convert(str(tmp_path / "job"), "-o", str(out))
    assert code == 0, err
    import gzip

    tracks = check_chrome_trace(json.loads(gzip.decompress(out.read_bytes())))
    assert len(tracks) == 2
    for slices in tracks.values():
        steps = [s["args"]["step"] for s in slices if s["cat"] == "train"]
        assert len(steps) >= 20 and steps == list(range(len(steps)))


def test_back_to_back_steps_never_overlap_by_a_rounding_microsecond() -> None:
    """Each step starts where the previous ended (float unix seconds, ns walls): whole-µs slices
    that overlap the previous step by 1 µs make Perfetto nest them or drop them."""
    import random

    from torchtop.monitor.export.perfetto import RankTrace, chrome_trace
    from torchtop.monitor.model.steps import StepRecord

    rng = random.Random(7)
    steps, t = [], T0 + 0.123456789
    for i in range(2000):
        wall = rng.randrange(200_000, 3_000_000)  # 0.2-3 ms
        steps.append(StepRecord(i, t, wall, {"forward": wall // 3, "other": wall - wall // 3}, "train"))
        t += wall / 1e9
    tracks = check_chrome_trace(chrome_trace([RankTrace(0, None, steps)]))
    (slices,) = tracks.values()
    step_slices = [e for e in slices if e["cat"] == "train"]
    assert len(step_slices) == 2000
    for prev, nxt in zip(step_slices, step_slices[1:]):
        assert nxt["ts"] >= prev["ts"] + prev["dur"], (prev, nxt)


def _steps(n: int, kinds: tuple[str, ...] = ("train",)) -> list[Any]:
    """Back-to-back steps on float unix seconds (each starts where the previous ended), of
    `kinds` in turn: runs of 40 train steps then 16 eval forwards, as a train+eval loop makes."""
    import random

    from torchtop.monitor.model.steps import StepRecord

    rng = random.Random(11)
    steps, t = [], T0 + 0.987654321
    for i in range(n):
        wall = rng.randrange(200_000, 3_000_000)
        kind = kinds[0] if len(kinds) == 1 or i % 56 < 40 else kinds[1]
        steps.append(StepRecord(i, t, wall, {"forward": wall // 3, "other": wall - wall // 3}, kind))  # type: ignore[arg-type]
        t += wall / 1e9
    return steps


def _no_overlap(events: list[dict[str, Any]]) -> None:
    slices = sorted((e for e in events if e["ph"] == "X"), key=lambda e: (e["ts"], -e["dur"]))
    steps = [e for e in slices if e["cat"] in ("train", "eval")]
    for prev, nxt in zip(steps, steps[1:]):  # a step never starts inside the previous one
        assert nxt["ts"] >= prev["ts"] + prev["dur"], (prev, nxt)


def test_steps_never_overlap_across_a_recordings_batches_or_kinds() -> None:
    """Issue 39: step slices began 1 us before the previous `other` ended (7-8 per 1,500 steps):
    the rounding fix did not carry from one batch of a recording to the next, nor from an eval
    step to a train step (one track)."""
    from torchtop.monitor.export.perfetto import RankTrace, rank_events

    steps = _steps(3000)
    chunks = [(steps[k : k + 1], []) for k in range(len(steps))]  # a batch a step: every boundary
    _no_overlap(list(rank_events(RankTrace(0, None, pid=1), chunks, T0)))
    mixed = _steps(3000, ("train", "eval"))
    _no_overlap(list(rank_events(RankTrace(0, None, pid=1), [(mixed, [])], T0)))


def _other_run(path: Path, run_id: str, job_id: str = "") -> Path:
    from msgspec import structs

    from tests.recording_util import batch, hello
    from torchtop.contract import recording_store as store

    w = store.RecordingWriter(path, 0, store.DEFAULT_MAX_BYTES)
    w.write(structs.replace(hello(run_id=run_id), job_id=job_id))
    for k in range(5):
        w.write(batch(k, run_id=run_id))
    w.close()
    return path


def test_two_unrelated_runs_are_not_traced_as_two_ranks(tmp_path: Path) -> None:
    """Issue 39: `trace f2.rec g.rec` merged two unrelated runs as "2 rank(s)" on one timeline."""
    a, b = _other_run(tmp_path / "a", "run-a"), _other_run(tmp_path / "b", "run-b")
    code, err = convert(str(a), str(b), "-o", str(tmp_path / "x.json"))
    assert code == 2 and "another run than" in err and "run run-b vs run run-a" in err, err
    assert not (tmp_path / "x.json").exists()
    # the ranks of one job, recorded apart (a node each), still make one trace
    n0 = _other_run(tmp_path / "n0", "run-c", job_id="job-1")
    n1 = _other_run(tmp_path / "n1", "run-d", job_id="job-1")
    code, err = convert(str(n0), str(n1), "-o", str(tmp_path / "job.json"))
    assert code == 0 and "2 ranks, 100 steps" in err, err


def test_the_traces_line_counts_eval_passes_apart_from_steps() -> None:
    """An eval-only run's trace read "1 rank, 472 steps" for 0 training steps."""
    from types import SimpleNamespace

    from torchtop.contract import wire
    from torchtop.monitor.commands.trace import _chunks
    from torchtop.monitor.model.steps import StepRecord

    msg = wire.Batch(v=wire.PROTOCOL_VERSION, run_id="r", seq=0, time=1.0)
    steps = [StepRecord(k, 1.0 + k, 1000, {}, "eval" if k % 3 else "train") for k in range(9)]
    pb = SimpleNamespace(play=lambda: [SimpleNamespace(msg=msg, steps=steps)])
    counts = [0, 0]
    assert [len(s) for s, _ in _chunks(pb, counts)] == [9]
    assert counts == [3, 6]
