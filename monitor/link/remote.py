"""One way for every command to open a TARGET: local pid, HOST:PORT, tcp:// with CURVE, ssh://.

`open_target` is a context manager because an ssh target holds a tunnel open while it is used;
`report`, `attach` and `capture` all go through it, so each works over every transport.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypedDict

from torchtop.contract import curve_keys
from torchtop.monitor.link.targets import Endpoint, TargetError, resolve_single


def add_arguments(p: argparse.ArgumentParser) -> None:
    """--server-key and --ssh-option, for commands that take a TARGET."""
    p.add_argument(
        "--server-key",
        metavar="PATH",
        help="the agent's CURVE public key file (server.key from `torchtop keys --server` there), for tcp:// targets",
    )
    p.add_argument(
        "--ssh-option",
        metavar="OPT",
        action="append",
        default=[],
        help="extra ssh -o option for ssh:// targets (repeatable); also $TORCHTOP_SSH_OPTS",
    )


@contextmanager
def open_target(
    target: str | None, server_key: str | None = None, ssh_options: list[str] | None = None
) -> Iterator[Endpoint]:
    """The endpoint of TARGET, with CURVE keys when `server_key` is given and an ssh tunnel for ssh://."""
    from torchtop.monitor.link import ssh

    if ssh.is_ssh(target):
        assert target is not None
        with ssh.open_ssh(target, ssh_options or ()) as endpoint:
            yield _with_key(endpoint, server_key)
        return
    yield _with_key(resolve_single(target), server_key)


def _with_key(endpoint: Endpoint, server_key: str | None) -> Endpoint:
    if not server_key:
        return endpoint
    try:
        # keys given by hand: kept (never swapped for a discovery entry's, see rediscover)
        return dataclasses.replace(endpoint, curve=curve_keys.load_client(server_key), local_entry=False)
    except curve_keys.KeyConfigError as exc:
        raise TargetError(str(exc)) from None


class TargetOptions(TypedDict):
    """open_target's keyword arguments, typed so that `**target_options(args)` checks."""

    server_key: str | None
    ssh_options: list[str] | None


def target_options(args: argparse.Namespace) -> TargetOptions:
    """open_target's keyword arguments from parsed args (absent flags are fine)."""
    return {"server_key": getattr(args, "server_key", None), "ssh_options": getattr(args, "ssh_option", None)}
