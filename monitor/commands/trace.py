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


def load_ranks(paths: list[str]) -> tuple[list[Any], list[str]]:
    """Every rank of every recording as a RankTrace (steps replayed, telemetry), and warnings."""
    from torchtop.agent.contract import wire
    from torchtop.agent.contract.recording_store import open_recording, read_rank
    from torchtop.monitor.export.perfetto import RankTrace
    from torchtop.monitor.model.playback import Playback

    out, warnings = [], []
    for path in paths:
        for rank, where in open_recording(Path(path)).items():
            pb = Playback(read_rank(where))
            warnings += pb.warnings
            r = RankTrace(rank, pb.hello)
            for p in pb.play():
                if isinstance(p.msg, wire.Batch):
                    r.steps += p.steps
                    if p.msg.telemetry is not None:
                        r.telemetry.append(p.msg.telemetry)
            out.append(r)
    return out, warnings


def read_json(path: str) -> dict[str, Any]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as fh:  # type: ignore[operator]
        data = json.load(fh)
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ValueError(f"{path}: not a Chrome trace (no traceEvents)")
    return data


def run(args: argparse.Namespace) -> int:
    from torchtop.agent.contract.recording import RecordingError
    from torchtop.monitor.export.perfetto import chrome_trace

    if not args.paths and not args.capture:
        print("torchtop: give recordings and/or --capture traces to convert", file=sys.stderr)
        return EXIT_USAGE
    try:
        ranks, warnings = load_ranks(args.paths)
        captures = [read_json(c) for c in args.capture]
    except (RecordingError, OSError, ValueError) as exc:
        print(f"torchtop: {exc}", file=sys.stderr)
        return EXIT_USAGE
    for line in warnings:
        print(f"torchtop: {line}", file=sys.stderr)
    trace = chrome_trace(ranks, captures)
    opener = gzip.open if args.output.endswith(".gz") else open
    with opener(args.output, "wt", encoding="utf-8") as fh:  # type: ignore[operator]
        json.dump(trace, fh)
    steps = sum(len(r.steps) for r in ranks)
    print(
        f"torchtop trace: {args.output}: {len(ranks)} rank(s), {steps} steps"
        + (f", {len(captures)} capture(s)" if captures else "")
        + "; open it in https://ui.perfetto.dev",
        file=sys.stderr,
    )
    return 0
