"""`torchtop replay FILE`: the TUI over a recording (pause, speed, seek, jump to a step or time)."""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    from torchtop.monitor.commands.args import positive

    p.add_argument(
        "path", help="a recording: the directory given to --record / TORCHTOP_RECORD, or a segment file"
    )
    p.add_argument(
        "--rank",
        type=int,
        default=None,
        help="a job's recording: one rank (default: the job view of every rank)",
    )
    p.add_argument(
        "--speed", type=positive, default=1.0, help="playback speed (default 1; ] and [ change it)"
    )
    p.add_argument(
        "--at", metavar="T", default=None, help="start at T into the recording (90, 1:30) or #STEP"
    )


def run(args: argparse.Namespace) -> int:
    from torchtop.contract.recording import RecordingError
    from torchtop.monitor.model.playback import load, notes

    try:
        playback, ranks = load(args.path, args.rank)
    except RecordingError as exc:
        print(f"torchtop: {exc}", file=sys.stderr)
        return 2
    if args.speed <= 0:
        print("torchtop: --speed must be positive", file=sys.stderr)
        return 2
    job = len(ranks) > 1 and args.rank is None  # a job's recording: the job view
    for line in [] if job else notes(playback, ranks, args.rank, "replaying"):
        print(f"torchtop: {line}", file=sys.stderr)
    from torchtop.monitor.commands.tui_entry import EXIT_NO_TUI, TuiMissing, require_tui

    try:
        require_tui()
    except TuiMissing as exc:
        print(f"torchtop: {exc}", file=sys.stderr)
        return EXIT_NO_TUI
    from torchtop.monitor.tui.playback_app import PlaybackApp, jump_target

    if job:
        return _replay_job(args, ranks)
    at = None
    if args.at is not None:
        try:
            at = jump_target(playback, args.at, playback.start)
        except ValueError:
            print(f"torchtop: --at {args.at!r}: give a time (90, 1:30) or #STEP", file=sys.stderr)
            return 2
    app = PlaybackApp(playback, speed=args.speed, at=at)
    app.run()
    return app.return_code or 0


def _replay_job(args: argparse.Namespace, ranks: dict) -> int:
    from torchtop.monitor.model.job_playback import JobPlayback
    from torchtop.monitor.tui.job_replay_app import JobReplayApp

    app = JobReplayApp(JobPlayback(ranks), speed=args.speed)
    if args.at is not None:
        try:
            app._start_at = app.jump_target(args.at)
        except ValueError:
            print(f"torchtop: --at {args.at!r}: give a time (90, 1:30) or #STEP", file=sys.stderr)
            return 2
    app.run()
    return app.return_code or 0
