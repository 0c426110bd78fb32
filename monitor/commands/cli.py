"""The `torchtop` command: ls, attach, report, demo.

Bad input (unknown target, dead agent, closed port) is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchtop.monitor.link.targets import Endpoint

EXIT_NO_AGENT = 2
ATTACH_HELLO_S = 5.0  # attach: how long the first hello may take before it is an error


def _fail(message: str, code: int = EXIT_NO_AGENT) -> int:
    print(f"torchtop: {message}", file=sys.stderr)
    return code


def cmd_ls(args: argparse.Namespace) -> int:
    from torchtop.monitor.link.targets import TargetError, local_agents

    if getattr(args, "relays", False):  # this node's relays: what a monitor elsewhere tunnels to
        from torchtop.monitor.relay.registry import list_relays

        print(json.dumps(list_relays()))
        return 0
    try:
        agents = local_agents() if not getattr(args, "target", None) else _remote_agents(args)
    except TargetError as exc:
        return _fail(str(exc))
    if args.json:
        from torchtop.contract.discovery import listing

        print(json.dumps([listing(a) for a in agents], indent=None))
        return 0
    if not agents:
        print(f"no torchtop agents running on {args.target or 'this machine'}")
        return 0
    from torchtop.monitor.commands.job_cli import ls_lines

    for line in ls_lines(agents):
        print(line)
    if not getattr(args, "target", None):
        from torchtop.monitor.relay.registry import list_relays

        for r in list_relays():  # this node's relays (docs/multi-rank.md)
            print(f"relay  pid {r.get('pid')}  node {r.get('node')}  job {r.get('job_id')}")
    return 0


def _remote_agents(args: argparse.Namespace) -> list:
    from torchtop.monitor.link import ssh

    if not ssh.is_ssh(args.target):
        raise ssh.SshError(f"`torchtop ls` takes an ssh://[user@]host target, not {args.target!r}")
    return ssh.remote_agents(ssh.parse(args.target), args.ssh_option)


def collect(endpoint, seconds: float, history: bool = False):  # type: ignore[no-untyped-def]
    """Connect, say hello, (with `history`, take the agent's retained steps), then feed
    `seconds` of batches into a RunState. Subscribed before the snapshot, so nothing falls
    between; batches the snapshot already covers are dropped by sequence number."""
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
        while (left := end - time.monotonic()) > 0:
            for got in client.recv_batches(min(left, 0.5)):
                state.apply_batch(got.batch, got.steps, time.monotonic(), got.log_errors)
        state.bad_frames += client.bad_frames
        state.last_error = state.last_error or client.last_error
        return state
    finally:
        client.close()


def _recording(target: str | None) -> bool:
    from pathlib import Path

    from torchtop.contract.recording_reader import is_recording

    try:
        return bool(target) and is_recording(Path(target))  # type: ignore[arg-type]
    except (OSError, ValueError):  # a name too long for a path, a NUL: not a file, maybe a target
        return False


def report_file(args: argparse.Namespace) -> int:
    """`report FILE`: the same JSON as live, over the recording's last S seconds (or up to --until)."""
    from torchtop.contract.recording import RecordingError
    from torchtop.monitor.diagnosis.report import build_report
    from torchtop.monitor.model.playback import load, notes, resolve_until

    try:
        playback, ranks = load(args.target, args.rank)
        until = resolve_until(playback, args.until)
    except (RecordingError, ValueError) as exc:
        return _fail(str(exc))
    if len(ranks) > 1 and args.rank is None:
        return _report_job_file(args, ranks, until)
    for line in notes(playback, ranks, args.rank, "reporting"):
        print(f"torchtop: {line}", file=sys.stderr)
    state = playback.state_until(until)
    window = float("inf") if args.history else args.seconds
    report = build_report(state, args.seconds, str(args.target), window=window)
    if len(ranks) > 1:  # one rank of a job carries the job's verdict
        report["verdict"] = _job_verdict_for(ranks, until, window, state, args.rank)
    print(json.dumps(report, indent=2 if args.pretty else None))
    return 0


def _job_verdict_for(ranks: dict, until: float | None, window: float, state, rank: int) -> dict:  # type: ignore[no-untyped-def]
    from torchtop.monitor.diagnosis.diagnose import diagnose
    from torchtop.monitor.diagnosis.job_diagnosis import diagnose_job, rank_times, rank_view
    from torchtop.monitor.model.job_playback import JobPlayback

    job = JobPlayback(ranks).job_until(until)
    job_diagnosis, found = diagnose_job(job, None, window)
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
    from torchtop.monitor.commands.job_cli import job_targets
    from torchtop.monitor.diagnosis.report import build_report
    from torchtop.monitor.link.client import AgentUnreachable
    from torchtop.monitor.link.remote import open_target, target_options
    from torchtop.monitor.link.targets import TargetError

    if args.seconds <= 0:
        return _fail("--seconds must be positive")
    args.target = args.targets[0] if args.targets else None
    if _recording(args.target):
        return report_file(args)
    if args.until is not None or args.rank is not None:
        return _fail("--until and --rank are for a recording: give its path as the target")
    try:
        targets = job_targets(args)
        if targets is not None:
            return _report_job(args, targets)
        with open_target(args.target, **target_options(args)) as endpoint:
            state = collect(endpoint, args.seconds, history=args.history)
    except (TargetError, AgentUnreachable) as exc:
        return _fail(str(exc))
    window = float("inf") if args.history else args.seconds
    report = build_report(state, args.seconds, str(endpoint), window=window)
    print(json.dumps(report, indent=2 if args.pretty else None))
    return 0


def _report_job(args: argparse.Namespace, targets: list[str]) -> int:
    """`report` over every rank of a job: one JSON object with a `ranks` list."""
    from torchtop.contract.wire import SNAPSHOT_MAX_STEPS
    from torchtop.monitor.commands.job_cli import collect_job
    from torchtop.monitor.diagnosis.job_diagnosis import build_job_report
    from torchtop.monitor.link.job_link import JobLink
    from torchtop.monitor.link.job_targets import open_job
    from torchtop.monitor.model.job_state import JobState

    with open_job(targets, args.job, args.ssh_option) as plan:
        link = JobLink(
            plan.endpoints, snapshot_steps=SNAPSHOT_MAX_STEPS if args.history else 0, relays=plan.relays
        )
        job = JobState(plan.job_id)
        for line in plan.notes:
            job.note(line)
        try:
            collect_job(link, job, args.seconds)
        finally:
            link.close()
        label = ", ".join(targets) or "this machine"
    if not job.ranked():  # nothing to report: say why, never an empty report that looks fine
        why = "; ".join(job.notes) or "none answered"
        return _fail(f"no rank of job {plan.job_id or label} answered ({why})")
    window = float("inf") if args.history else args.seconds
    report = build_job_report(job, args.seconds, label, window, time.monotonic(), args.baseline_ms)
    print(json.dumps(report, indent=2 if args.pretty else None))
    return 0


def first_contact(endpoint: Endpoint, timeout: float = ATTACH_HELLO_S) -> None:
    """AgentUnreachable (the headless commands' one line) unless the agent answers a hello within
    `timeout`: a wrong or closed port ends here instead of in a TUI that waits forever. Once the
    TUI has seen the agent, it waits for it across restarts as before."""
    from torchtop.monitor.link.client import AgentClient

    client = AgentClient(endpoint)
    try:
        client.hello(timeout=timeout)
    finally:
        client.close()


def cmd_attach(args: argparse.Namespace) -> int:
    from pathlib import Path

    from torchtop.monitor.commands.job_cli import job_targets
    from torchtop.monitor.commands.tui_entry import TuiMissing, require_tui
    from torchtop.monitor.link.client import AgentUnreachable
    from torchtop.monitor.link.remote import open_target, target_options
    from torchtop.monitor.link.targets import TargetError, from_discovery, local_agents, no_agent_message

    args.target = args.targets[0] if args.targets else None
    record = Path(args.record) if args.record else None
    try:
        require_tui()
    except TuiMissing as exc:
        return _fail(str(exc))
    from torchtop.monitor.tui.app import run_tui

    try:
        targets = job_targets(args)
        if targets is not None:
            if record is not None:
                return _fail(
                    "--record records one agent's stream; for a job, let each rank record its own "
                    "(TORCHTOP_RECORD=DIR, or `torchtop run --record DIR -- torchrun ...`)"
                )
            from torchtop.monitor.tui.job_launch import run_job_tui

            return run_job_tui(targets, args.job, args.ssh_option, args.baseline_ms)
        if args.target:
            with open_target(args.target, **target_options(args)) as endpoint:
                first_contact(endpoint)
                return run_tui(endpoint, None, record=record)
        agents = local_agents()
        if not agents:
            return _fail(no_agent_message())
        if len(agents) == 1:
            first_contact(from_discovery(agents[0]))
    except (TargetError, AgentUnreachable) as exc:
        return _fail(str(exc))
    return run_tui(None, agents, record=record)


def cmd_demo(args: argparse.Namespace) -> int:
    from torchtop.monitor.commands.demo import run_demo

    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    from torchtop.monitor.commands.args import Parser, seconds

    parser = Parser(prog="torchtop", description="htop for a PyTorch training run")
    sub = parser.add_subparsers(dest="command", required=True)

    from torchtop.monitor.commands import keys as keys_cli
    from torchtop.monitor.link import remote

    p = sub.add_parser("ls", help="list the agents running on this machine (or on ssh://[user@]host)")
    p.add_argument("target", nargs="?", help="ssh://[user@]host[:sshport]: list the agents there")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--relays", action="store_true", help="list this node's relays (JSON), not its agents")
    p.add_argument("--ssh-option", metavar="OPT", action="append", default=[], help="extra ssh -o option")
    p.set_defaults(func=cmd_ls)

    from torchtop.monitor.commands import job_cli

    p = sub.add_parser(
        "attach", help="open the live TUI on a run, or on every rank of a job (the TUI needs torchtop[tui])"
    )
    p.add_argument(
        "targets",
        nargs="*",
        metavar="target",
        help="pid, HOST:PORT, tcp://HOST:PORT or ssh://[user@]host[/pid] (default: the local agent, "
        "or the local job); several, or ssh hosts running a job: the job view",
    )
    remote.add_arguments(p)
    job_cli.add_arguments(p)
    p.add_argument(
        "--record",
        metavar="PATH",
        default=None,
        help="also record what this monitor receives into PATH (replay it with `torchtop replay PATH`)",
    )
    p.set_defaults(func=cmd_attach)

    p = sub.add_parser(
        "report",
        help="collect S seconds (or read a recording) and print one JSON report (of a job: every rank)",
    )
    p.add_argument(
        "targets",
        nargs="*",
        metavar="target",
        help="pid, HOST:PORT, tcp://HOST:PORT, ssh://[user@]host[/pid] (default: the local agent, or the "
        "local job; several, or ssh hosts running a job: a job report), or a recording's path (its last S seconds)",
    )
    remote.add_arguments(p)
    job_cli.add_arguments(p)
    p.add_argument("--seconds", type=seconds, default=10.0, help="how long to collect (default 10)")
    p.add_argument("--pretty", action="store_true", help="indent the JSON")
    p.add_argument(
        "--history",
        action="store_true",
        help="report over the whole run: every step counted from the run's start, the last ~15,000 "
        "kept whole (and one per 0.1 s for 10 minutes before those), not only the last S seconds",
    )
    p.add_argument(
        "--until",
        metavar="T",
        help="a recording: the window ends here (seconds into it, 1:30, or a unix time; default: its end)",
    )
    p.add_argument(
        "--rank", type=int, default=None, help="a job's recording: which rank (default: the lowest)"
    )
    p.set_defaults(func=cmd_report)

    from torchtop.monitor.commands import capture, compare, export, replay, trace
    from torchtop.monitor.commands import run as run_cmd

    # commands with their own module: (name, module, help, takes remote options)
    for name, module, text, remote_options in (
        (
            "capture",
            capture,
            "capture a torch.profiler trace (or CUDA memory snapshot) of the next steps",
            True,
        ),
        ("keys", keys_cli, "make CURVE keys for direct remote access (SSH needs none)", False),
        (
            "run",
            run_cmd,
            "run a training command with the agent injected: torchtop run -- python train.py "
            "(its TUI needs torchtop[tui]; --no-tui does not)",
            False,
        ),
        ("replay", replay, "the TUI over a recording: pause, speed, seek, jump to a step or time", False),
        (
            "compare",
            compare,
            "recordings side by side, each against the first (or --demo amp|workers)",
            False,
        ),
        ("export", export, "headless: agents' figures as Prometheus (/metrics) and/or OTLP metrics", True),
        (
            "trace",
            trace,
            "recordings (and capture traces) to one Perfetto/Chrome trace, a track per rank",
            False,
        ),
    ):
        p = sub.add_parser(name, help=text)
        module.add_arguments(p)
        if remote_options:
            remote.add_arguments(p)
        p.set_defaults(func=module.run)

    from torchtop.monitor.commands.demo import add_demo_arguments

    p = sub.add_parser(
        "demo", help="run a demo training job with the agent and open the TUI on it (--no-tui: without)"
    )
    add_demo_arguments(p)
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
