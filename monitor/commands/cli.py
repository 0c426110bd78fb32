"""The `torchtop` command: ls, attach, report (report.py), demo.

Bad input (unknown target, dead agent, closed port) is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from torchtop.monitor.commands.args import fail
from torchtop.monitor.commands.report import cmd_report

if TYPE_CHECKING:
    from torchtop.monitor.link.targets import Endpoint

ATTACH_HELLO_S = 5.0  # attach: how long the first hello may take before it is an error


def cmd_ls(args: argparse.Namespace) -> int:
    from torchtop.monitor.link.targets import TargetError, printable

    if getattr(args, "relays", False):  # this node's relays: what a monitor elsewhere tunnels to
        from torchtop.monitor.relay.registry import list_relays

        bad_relays: list[str] = []
        print(json.dumps([r.to_json() for r in list_relays(skipped=bad_relays)]))
        for line in bad_relays:  # stdout stays one JSON line (a monitor elsewhere reads it)
            print(printable(f"torchtop: skipped {line}"), file=sys.stderr)
        return 0
    from torchtop.contract.discovery import Skipped, scan

    skipped: list[Skipped] = []
    try:
        agents, skipped = scan() if not getattr(args, "target", None) else (_remote_agents(args), [])
    except TargetError as exc:
        return fail(str(exc))
    for s in skipped:  # a file there that is no entry: said, never raised nor removed
        print(printable(f"skipped {s.file}: {s.reason}"), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        from torchtop.contract.discovery import listing

        print(json.dumps([listing(a) for a in agents], indent=None))
        return 0
    if not agents:
        print(f"no torchtop agents running on {args.target or 'this machine'}")
        return 0
    from torchtop.monitor.commands.job_cli import ls_lines

    for line in ls_lines(agents):
        print(printable(line))  # every field of a discovery file, the job's and its ranks' lines too
    if not getattr(args, "target", None):
        from torchtop.monitor.relay.registry import list_relays

        bad_relays: list[str] = []
        for r in list_relays(skipped=bad_relays):  # this node's relays (docs/multi-rank.md)
            print(printable(f"relay  pid {r.pid}  node {r.node}  job {r.job_id}"))
        for line in bad_relays:  # a file there that is no relay's entry: named, never raised on
            print(printable(f"skipped {line}"))
    return 0


def _remote_agents(args: argparse.Namespace) -> list:
    from torchtop.monitor.link import ssh

    if not ssh.is_ssh(args.target):
        raise ssh.SshError(f"`torchtop ls` takes an ssh://[user@]host target, not {args.target!r}")
    return ssh.remote_agents(ssh.parse(args.target), args.ssh_option)


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
        return fail(str(exc))
    from torchtop.monitor.tui.app import run_tui

    try:
        targets = job_targets(args)
        if targets is not None:
            if record is not None:
                return fail(
                    "--record records one agent's stream; for a job, let each rank record its own "
                    "(TORCHTOP_RECORD=DIR, or `torchtop run --record DIR -- torchrun ...`)"
                )
            from torchtop.monitor.tui.job_launch import run_job_tui

            return run_job_tui(
                targets, args.job, args.ssh_option, args.baseline_ms, notes=getattr(args, "store_notes", ())
            )
        if args.target:
            with open_target(args.target, **target_options(args)) as endpoint:
                first_contact(endpoint)
                return run_tui(endpoint, None, record=record)
        agents = local_agents()
        if not agents:
            return fail(no_agent_message())
        agents = [a for a in agents if a.unusable is None] or agents[:1]  # the chooser: usable ones only
        if len(agents) == 1:
            first_contact(from_discovery(agents[0]))
    except (TargetError, AgentUnreachable) as exc:
        return fail(str(exc))
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
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a reader gone shows here, not as a traceback at exit
        return code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        if not _stdout_gone():
            raise
        # `torchtop ls | head`: Python's documented recipe, devnull on stdout so the exit's flush
        # is quiet, and the exit status a program killed by SIGPIPE has
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def _stdout_gone() -> bool:
    """Whether stdout's reader went away (a pipe closed: POLLERR), so the BrokenPipeError was its."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poll.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll here, or stdout has no descriptor
        return False


if __name__ == "__main__":
    sys.exit(main())
