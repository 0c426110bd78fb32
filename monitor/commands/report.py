"""`torchtop report`: a JSON report of one agent, a job's ranks or a recording, over the last
S seconds (or the whole history); one line on stderr and exit code 2 when it cannot."""

from __future__ import annotations

import argparse
import json
import sys
import time

from torchtop.monitor.commands.args import fail


def collect(endpoint, seconds: float, history: bool = False, events=None):  # type: ignore[no-untyped-def]
    """Connect, say hello, (with `history`, take the agent's retained steps), then feed
    `seconds` of batches into a RunState. Subscribed before the snapshot, so nothing falls
    between; batches the snapshot already covers are dropped by sequence number. `events` (an
    EventLog): the run judged once a second meanwhile, as the live view does (its events)."""
    from torchtop.monitor.diagnosis.diagnose import diagnose
    from torchtop.monitor.diagnosis.events import TICK_S
    from torchtop.monitor.link.client import AgentClient, AgentUnreachable
    from torchtop.monitor.model.state import RunState

    client = AgentClient(endpoint)
    state = RunState()
    try:
        state.apply_hello(client.hello())
        if history:
            from torchtop.contract.wire import SNAPSHOT_MAX_STEPS

            reply, steps = client.snapshot(max_steps=SNAPSHOT_MAX_STEPS, timeout=10.0)
            if reply.ok:
                state.apply_snapshot(steps, reply.seq, reply.tally, reply.wall_offset)
                state.apply_memory(reply.memory)
        else:  # the leak rule looks back a minute, further than a short report collects
            try:
                state.apply_memory(client.memory())
            except AgentUnreachable:
                pass  # the live points alone, then
        end = time.monotonic() + seconds
        due = 0.0
        while (left := end - time.monotonic()) > 0:
            for got in client.recv_batches(min(left, 0.5)):
                state.apply_batch(got.batch, got.steps, time.monotonic(), got.log_errors)
            if events is not None and state.steps and time.monotonic() >= due:
                due = time.monotonic() + TICK_S
                events.observe(diagnose(state, events.last), state.agent_time)
        if not history and len(state.window(seconds)) < 2:
            _widen(client, state)
        state.bad_frames += client.bad_frames
        state.last_error = state.last_error or client.last_error
        return state
    finally:
        client.close()


def _widen(client, state) -> None:  # type: ignore[no-untyped-def]
    """Steps longer than the window: the agent's last steps, so that the report judges the steps
    it can see (run_report widens its window to them and says so) instead of none."""
    from torchtop.monitor.diagnosis.facts import THRESHOLDS as T

    reply, steps = client.snapshot(max_steps=int(T.warmup_steps + T.window_steps), timeout=10.0)
    if reply.ok:
        state.apply_snapshot(steps, reply.seq, reply.tally, reply.wall_offset)


def _recording(target: str | None) -> bool:
    from pathlib import Path

    from torchtop.contract.recording_reader import is_recording

    try:
        return bool(target) and is_recording(Path(target))  # type: ignore[arg-type]
    except (OSError, ValueError):  # a name too long for a path, a NUL: not a file, maybe a target
        return False


def report_file(args: argparse.Namespace) -> int:
    """`report FILE`: the same JSON as live, over the recording's last S seconds (or up to --until)."""
    import msgspec

    from torchtop.contract.recording import RecordingError
    from torchtop.monitor.diagnosis.events import replayed
    from torchtop.monitor.diagnosis.report import build_report
    from torchtop.monitor.model.playback import load, notes, resolve_until

    try:
        playback, ranks = load(args.target, args.rank)
        until = resolve_until(playback, args.until)
    except (RecordingError, ValueError) as exc:
        return fail(str(exc))
    if len(ranks) > 1 and args.rank is None:
        return _report_job_file(args, ranks, until)
    for line in notes(playback, ranks, args.rank, "reporting"):
        print(f"torchtop: {line}", file=sys.stderr)
    state = playback.state_until(until)
    window = float("inf") if args.history else args.seconds
    report = build_report(state, args.seconds, str(args.target), window=window, widen=True)
    # events are not stored: the recording's steps judged again a second at a time (events.py)
    report["events"] = msgspec.to_builtins(replayed(playback, until, window))
    if len(ranks) > 1:  # one rank of a job carries the job's verdict
        report["verdict"] = _job_verdict_for(ranks, until, window, state, args.rank)
    print(json.dumps(report, indent=2 if args.pretty else None))
    return 0


def _job_verdict_for(ranks: dict, until: float | None, window: float, state, rank: int) -> dict:  # type: ignore[no-untyped-def]
    from torchtop.monitor.diagnosis.diagnose import diagnose
    from torchtop.monitor.diagnosis.job_diagnosis import rank_times, rank_view, settled_job
    from torchtop.monitor.model.job_playback import JobPlayback

    job = JobPlayback(ranks).job_until(until)
    job_diagnosis, found = settled_job(job, window)
    return rank_view(job_diagnosis, diagnose(state), rank, found, rank_times(job, window)).verdict.to_json()


def _report_job_file(args: argparse.Namespace, ranks: dict, until: float | None) -> int:
    """`report DIR` of a job's recording: the job report, as `report` on the live job prints it."""
    from torchtop.monitor.diagnosis.job_diagnosis import build_job_report
    from torchtop.monitor.model.job_playback import JobPlayback

    played = JobPlayback(ranks)
    for line in played.warnings:
        print(f"torchtop: {line}", file=sys.stderr)
    job = played.job_until(until)
    window = float("inf") if args.history else args.seconds
    now = played.end if until is None else min(until, played.end)
    report = build_job_report(job, args.seconds, str(args.target), window, now, args.baseline_ms)
    print(json.dumps(report, indent=2 if args.pretty else None))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    import msgspec

    from torchtop.monitor.commands.job_cli import job_targets
    from torchtop.monitor.diagnosis.events import EventLog
    from torchtop.monitor.diagnosis.report import build_report
    from torchtop.monitor.link.client import AgentUnreachable
    from torchtop.monitor.link.remote import open_target, target_options
    from torchtop.monitor.link.targets import TargetError

    if args.seconds <= 0:
        return fail("--seconds must be positive")
    args.target = args.targets[0] if args.targets else None
    if _recording(args.target):
        return report_file(args)
    if args.until is not None or args.rank is not None:
        return fail("--until and --rank are for a recording: give its path as the target")
    try:
        targets = job_targets(args)
        if targets is not None:
            return _report_job(args, targets)
        log = EventLog()
        with open_target(args.target, **target_options(args)) as endpoint:
            state = collect(endpoint, args.seconds, history=args.history, events=log)
    except (TargetError, AgentUnreachable) as exc:
        return fail(str(exc))
    window = float("inf") if args.history else args.seconds
    report = build_report(state, args.seconds, str(endpoint), window=window, widen=True)
    report["events"] = msgspec.to_builtins(list(log.events))  # those seen while it collected
    print(json.dumps(report, indent=2 if args.pretty else None))
    return 0


def _report_job(args: argparse.Namespace, targets: list[str]) -> int:
    """`report` over every rank of a job: one JSON object with a `ranks` list."""
    import msgspec

    from torchtop.contract.wire import SNAPSHOT_MAX_STEPS
    from torchtop.monitor.commands.job_cli import collect_job
    from torchtop.monitor.diagnosis.events import EventLog
    from torchtop.monitor.diagnosis.job_diagnosis import JUDGE_STEPS, build_job_report
    from torchtop.monitor.link.job_link import JobLink
    from torchtop.monitor.link.job_targets import open_job
    from torchtop.monitor.model.job_state import JobState

    with open_job(targets, args.job, args.ssh_option, getattr(args, "store_notes", ())) as plan:
        link = JobLink(
            plan.endpoints,
            snapshot_steps=SNAPSHOT_MAX_STEPS if args.history else JUDGE_STEPS,
            relays=plan.relays,
        )
        job = JobState(plan.job_id)
        for line in plan.notes:
            job.note(line)
        log = EventLog()
        try:
            collect_job(link, job, args.seconds, events=log)
        finally:
            link.close()
        label = ", ".join(targets) or "this machine"
    if not job.ranked():  # nothing to report: say why, never an empty report that looks fine
        why = "; ".join(job.notes) or "none answered"
        return fail(f"no rank of job {plan.job_id or label} answered ({why})")
    window = float("inf") if args.history else args.seconds
    report = build_job_report(job, args.seconds, label, window, time.monotonic(), args.baseline_ms)
    report["events"] = msgspec.to_builtins(list(log.events))  # those seen while it collected
    print(json.dumps(report, indent=2 if args.pretty else None))
    return 0
