"""Running a node's relay as its own process: the job's lock, the discovery entry, the store.

`python -m torchtop.monitor.relay` calls `serve`; node.py is the relay itself.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import zmq

from torchtop.contract.relay import RelayInfo
from torchtop.monitor.relay import registry
from torchtop.monitor.relay.node import Relay


def serve(
    job_id: str, node: str = "", store: tuple[str, int] | None = None, tcp: tuple[str, int] | None = None
) -> int:
    """Run this node's relay of `job_id` until its ranks are gone; 0, or 1 when another runs."""
    held = registry.lock(job_id)
    if held is None:
        return 1  # another relay of this job runs on this node
    relay = Relay(job_id, node)
    if tcp is not None:
        from torchtop.contract.curve_keys import KeyConfigError

        try:
            relay.listen_tcp(*tcp)
        except (KeyConfigError, zmq.ZMQError) as exc:  # ipc only, as without --port
            print(f"torchtop relay: not listening on {tcp[0]}:{tcp[1]}: {exc}", file=sys.stderr)
    entry = relay.entry()
    if store is not None:
        threading.Thread(target=_register, args=(store, entry), daemon=True).start()
    registry.write(entry)
    try:
        relay.run()
    finally:
        registry.remove(os.getpid())
        relay.close()
        os.close(held)
    return 0


def _register(store: tuple[str, int], entry: RelayInfo) -> None:
    from torchtop.monitor.link.store import StoreError, publish_relay

    for _ in range(10):  # the store comes up with the job: try for a while
        try:
            publish_relay(store[0], store[1], entry.job_id, entry)
            return
        except StoreError as exc:
            last = str(exc)
        time.sleep(3)
    print(f"torchtop relay: not registered in the job's store: {last}", file=sys.stderr)
