"""`python -m torchtop.monitor.relay --job ID`: this node's relay of a job (started by the node's
first agent, or by `torchtop run`); exits when the job's ranks on the node are gone."""

from __future__ import annotations

import argparse
import os
import sys

from torchtop.monitor.link.store import parse_store, store_of_job
from torchtop.monitor.relay.serve import serve

RELAY_NAME = b"torchtop-relay"  # its process name: an agent's Host tab tells it from a worker starting


def _name_process() -> None:
    """Linux: this process's name (comm) says what it is; elsewhere, or refused, it stays."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, RELAY_NAME, 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    _name_process()
    p = argparse.ArgumentParser(
        prog="python -m torchtop.monitor.relay", description=(__doc__ or "").splitlines()[0]
    )
    p.add_argument("--job", required=True, help="the job id (agent/identity.py)")
    p.add_argument("--node", default="", help="the node's name (default: $TORCHTOP_NODE, else the host name)")
    p.add_argument(
        "--store",
        default=None,
        help="HOST:PORT of the job's rendezvous store (default: $MASTER_ADDR:$MASTER_PORT)",
    )
    p.add_argument(
        "--port",
        type=int,
        default=int(os.environ.get("TORCHTOP_RELAY_PORT") or 0) or None,
        help="also listen on TCP PORT and PORT+1, CURVE only (configured keys: `torchtop keys --server`); "
        "default $TORCHTOP_RELAY_PORT, else ipc only",
    )
    p.add_argument(
        "--bind", default=os.environ.get("TORCHTOP_RELAY_BIND", "0.0.0.0"), help="the TCP bind address"
    )
    args = p.parse_args(argv)
    store = None
    try:
        if args.store:
            store = parse_store(args.store)
        elif os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
            store = parse_store(f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
        else:
            store = store_of_job(args.job)
    except ValueError as exc:
        print(f"torchtop relay: {exc}", file=sys.stderr)
    if os.environ.get("TORCHTOP_RELAY_STORE") == "0":
        store = None
    return serve(args.job, args.node, store, (args.bind, args.port) if args.port else None)


if __name__ == "__main__":
    sys.exit(main())
