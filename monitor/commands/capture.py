"""`torchtop capture`: ask the agent for a profiler trace or memory snapshot, wait, print it.

Exit 0 with the file's path and the summary; non-zero with the agent's reason on failure.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import msgspec

from torchtop.contract.capture import (
    CAPTURE_DEFAULT_STEPS,
    CAPTURE_FINISHED,
    MEMORY_MAX_STEPS,
    MEMORY_SECONDS,
    PROFILE_MAX_STEPS,
    CaptureState,
)
from torchtop.contract.request_commands import Command
from torchtop.monitor.model.captures import capture_lines, fetch_from


def add_arguments(p: argparse.ArgumentParser) -> None:
    from torchtop.monitor.commands.args import seconds

    p.add_argument(
        "target",
        nargs="?",
        help="pid, HOST:PORT, tcp://HOST:PORT or ssh://[user@]host[/pid] (default: the local agent)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"steps to capture (default {CAPTURE_DEFAULT_STEPS}; at most {PROFILE_MAX_STEPS} for a "
        f"profile, {MEMORY_MAX_STEPS} for a memory snapshot)",
    )
    p.add_argument("--memory", action="store_true", help="a CUDA memory snapshot instead of a profiler trace")
    p.add_argument(
        "--seconds",
        type=seconds,
        default=None,
        help=f"memory snapshot: record this long ({MEMORY_SECONDS[0]:g} to {MEMORY_SECONDS[1]:g} s) "
        "instead of N steps",
    )
    p.add_argument("--with-stack", action="store_true", help="profiler: record Python stacks (costly)")
    p.add_argument("--record-shapes", action="store_true", help="profiler: record input shapes")
    p.add_argument("--profile-memory", action="store_true", help="profiler: record allocations")
    p.add_argument(
        "--timeout", type=seconds, default=300.0, help="give up after this many seconds (default 300)"
    )
    p.add_argument("--json", action="store_true", help="print the capture as JSON")


def request_args(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    if args.memory:
        out: dict[str, Any] = {}
        if args.seconds is not None:
            out["seconds"] = args.seconds
        if args.steps is not None:
            out["steps"] = args.steps
        return Command.CAPTURE_MEMORY, out
    out = {"steps": args.steps if args.steps is not None else CAPTURE_DEFAULT_STEPS}
    for flag in ("with_stack", "record_shapes", "profile_memory"):
        if getattr(args, flag):
            out[flag] = True
    return Command.CAPTURE_PROFILE, out


def run(args: argparse.Namespace) -> int:
    from contextlib import ExitStack

    from torchtop.monitor.link.client import AgentClient, AgentUnreachable
    from torchtop.monitor.link.remote import open_target, target_options
    from torchtop.monitor.link.targets import TargetError

    cmd, req = request_args(args)
    tunnel = ExitStack()  # an ssh:// target's tunnel stays open until the capture is done
    try:
        endpoint = tunnel.enter_context(open_target(args.target, **target_options(args)))
    except TargetError as exc:
        print(f"torchtop: {exc}", file=sys.stderr)
        return 2
    client = AgentClient(endpoint)
    try:
        reply = client.request(cmd, req, timeout=5.0)
        if not reply.ok or reply.capture is None:
            print(f"torchtop: capture refused: {reply.error}", file=sys.stderr)
            return 1
        want = reply.capture.id
        deadline = time.monotonic() + args.timeout
        last = ""
        while time.monotonic() < deadline:
            status = client.request(Command.CAPTURE_STATUS, timeout=5.0)
            found = next((c for c in status.captures if c.id == want), None)
            if found is not None and found.state in CAPTURE_FINISHED:
                if args.json:
                    print(json.dumps(msgspec.to_builtins(found)))
                else:  # the scp line only for a file on another machine
                    print(
                        "\n".join(capture_lines(found, fetch_from(str(endpoint), endpoint.host, found.host)))
                    )
                return 0 if found.state == CaptureState.DONE else 1
            if found is not None and not args.json:
                line = f"{found.kind}: {found.state} {found.steps_done}/{found.steps_total or '-'} steps"
                if line != last:
                    print(line, file=sys.stderr)
                    last = line
            time.sleep(0.25)
        print(f"torchtop: capture {want} did not finish within {args.timeout:g}s", file=sys.stderr)
        return 1
    except AgentUnreachable as exc:
        print(f"torchtop: {exc}", file=sys.stderr)
        return 2
    finally:
        client.close()
        tunnel.close()
