"""`torchtop trace`: recordings (every rank of each) and capture traces to one Perfetto trace.

    torchtop trace RUN_DIR -o run.json                    # a track per rank; open in ui.perfetto.dev
    torchtop trace RUN_DIR --capture torchtop-captures/....pt.trace.json.gz -o run.json

The output is the JSON trace-event format (export/perfetto.py), gzipped when the name ends in .gz.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections.abc import Iterator
from itertools import chain
from pathlib import Path
from typing import Any

EXIT_USAGE = 2


def add_arguments(p: argparse.ArgumentParser) -> None:
    from torchtop.monitor.commands.args import output_file

    p.add_argument("paths", nargs="*", help="recordings: a job's directory gives every rank")
    p.add_argument(
        "--capture",
        action="append",
        default=[],
        metavar="FILE",
        help="a capture's profiler trace to merge in (repeatable)",
    )
    p.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="FILE",
        type=output_file,
        help="the trace to write (.json or .json.gz)",
    )


def open_ranks(paths: list[str]) -> tuple[list[tuple[Any, Any]], list[str]]:
    """Every rank of every recording as (RankTrace without steps, Playback: an index, not the
    messages), and the warnings."""
    from torchtop.contract.recording import RecordingError
    from torchtop.contract.recording_reader import open_recording, rank_dirs, read_rank
    from torchtop.monitor.export.perfetto import RankTrace
    from torchtop.monitor.model.playback import Playback

    out, warnings = [], []
    seen: dict[tuple[str, str], str] = {}  # a job's (or a lone run's) id: the first path holding it
    for path in paths:
        found = open_recording(Path(path))
        warnings += rank_dirs(Path(path))[1] if Path(path).is_dir() else []
        before = len(out)
        for rank, where in found.items():
            try:
                pb = Playback(read_rank(where))
            except RecordingError as exc:  # a rank that died before its first batch: the others are read
                if len(found) == 1:
                    raise
                warnings.append(f"rank {rank} left out: {exc}")
                continue
            warnings += pb.warnings
            out.append((RankTrace(rank, pb.hello), pb))
        if len(out) == before:
            raise RecordingError(f"{path}: no rank of it can be read")
        ids = {_run_of(pb.hello) for _, pb in out[before:]}
        if seen and not ids & seen.keys():  # one timeline for two runs would put them side by side as ranks
            key, first = next(iter(seen.items()))
            raise RecordingError(
                f"{path} is another run than {first} ({', '.join(sorted(map(_label, ids)))} vs "
                f"{_label(key)}): trace one run, or the recordings of one job, at a time"
            )
        seen.update((i, path) for i in ids if i not in seen)
    return out, warnings


def _run_of(hello: Any) -> tuple[str, str]:
    """What ties ranks together: their job's id, or a lone process's run id."""
    if hello is None:
        return "run", "?"
    return ("job", hello.job_id) if hello.job_id else ("run", hello.run_id)


def _label(key: tuple[str, str]) -> str:
    from torchtop.monitor.link.job_targets import short_job_id

    return f"{key[0]} {short_job_id(key[1]) if key[0] == 'job' else key[1]}"


def _chunks(pb: Any, counts: list[int]) -> Iterator[tuple[list[Any], list[Any]]]:
    """A recording's steps and telemetry, batch by batch (`counts`: its training steps, its eval passes)."""
    from torchtop.contract import wire

    for p in pb.play():
        if isinstance(p.msg, wire.Batch):
            passes = sum(1 for s in p.steps if s.kind != "train")
            counts[0] += len(p.steps) - passes
            counts[1] += passes
            yield p.steps, [p.msg.telemetry] if p.msg.telemetry is not None else []


def _start(pb: Any) -> float | None:
    """The earliest time a rank's trace shows: its first step's start or first sample."""
    step = sample = None
    for steps, telemetry in _chunks(pb, [0, 0]):
        if steps and step is None:
            step = steps[0].t0
        if telemetry and sample is None:
            sample = telemetry[0].time
        if step is not None and sample is not None:
            break
    found = [x for x in (step, sample) if x is not None]
    return min(found) if found else None


def read_json(path: str) -> dict[str, Any]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as fh:  # type: ignore[operator]
        data = json.load(fh)
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ValueError(f"{path}: not a Chrome trace (no traceEvents)")
    return data


def run(args: argparse.Namespace) -> int:
    from torchtop.contract.recording import RecordingError
    from torchtop.monitor.export.perfetto import capture_events, capture_start, rank_events, write_trace
    from torchtop.monitor.model.fmt import plural

    if not args.paths and not args.capture:
        print("torchtop: give recordings and/or --capture traces to convert", file=sys.stderr)
        return EXIT_USAGE
    try:
        ranks, warnings = open_ranks(args.paths)
        captures = [read_json(c) for c in args.capture]
    except (RecordingError, OSError, ValueError) as exc:
        print(f"torchtop: {exc}", file=sys.stderr)
        return EXIT_USAGE
    for line in warnings:
        print(f"torchtop: {line}", file=sys.stderr)
    starts = [x for _, pb in ranks for x in [_start(pb)] if x is not None]
    starts += [x for x in map(capture_start, captures) if x is not None]
    origin = min(starts) if starts else 0.0
    for k, (r, _) in enumerate(ranks, 1):  # 0 is not a good pid for every viewer
        r.pid = k
    counts = [0, 0]
    events = chain(
        *(rank_events(r, _chunks(pb, counts), origin) for r, pb in ranks),
        *(capture_events(c, [r for r, _ in ranks], origin) for c in captures),
    )
    opener = gzip.open if args.output.endswith(".gz") else open
    try:
        with opener(args.output, "wt", encoding="utf-8") as fh:  # type: ignore[operator]
            write_trace(fh, events, origin)
    except OSError as exc:
        print(f"torchtop: cannot write {args.output}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    steps, passes = counts
    print(
        f"torchtop trace: {args.output}: {len(ranks)} {plural(len(ranks), 'rank')}, {steps} {plural(steps, 'step')}"
        + (f", {passes} eval {plural(passes, 'pass', 'passes')}" if passes else "")
        + (f", {len(captures)} {plural(len(captures), 'capture')}" if captures else "")
        + "; open it in https://ui.perfetto.dev",
        file=sys.stderr,
    )
    return 0
