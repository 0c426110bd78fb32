"""The node's relay, started by the job's first rank on the node (local rank 0).

The relay (torchtop.monitor.relay, docs/multi-rank.md) runs in a process of its own, started
once from the agent thread: the training thread never sees it, and the relay's CPU is not the
training process's. It outlives no job: it exits once the job's ranks on the node are gone. Only
the name of its module is used here (the agent never imports the monitor). TORCHTOP_RELAY=0
turns it off; a second relay of the same job on the node exits at once (the relay's lock).
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import time
from typing import Any

from torchtop.agent.identity import Identity

ENV = "TORCHTOP_RELAY"
MAX_RESTARTS = 5
RESTART_AFTER_S = 10.0  # a relay that died is started again after this (its node shows silent meanwhile)


def wanted(ident: Identity, env: dict[str, str] | None = None) -> bool:
    if not (ident.job_id and ident.world_size > 1 and ident.local_rank == 0):
        return False  # first: asked once a second, and os.environ decodes what it reads
    value = (os.environ if env is None else env).get(ENV, "1")
    return value.strip().lower() not in ("0", "false", "no", "off")


class RelayStarter:
    def __init__(self) -> None:
        self.proc: Any = None
        self.tried = False
        self.restarts = 0
        self.retry_at = 0.0

    def tick(self, ident: Identity) -> None:
        """Agent thread, once a second: start the relay the first time this rank should."""
        if self.proc is not None and self.proc.poll() is not None:
            # reaped. Exit 1: another relay of the job runs here; anything else (killed, crashed)
            # while the job runs: started again, a few times
            if self.proc.returncode not in (0, 1) and self.restarts < MAX_RESTARTS:
                self.restarts += 1
                self.retry_at = time.monotonic() + RESTART_AFTER_S
                self.tried = False
            self.proc = None
        if self.tried or not wanted(ident) or time.monotonic() < self.retry_at:
            return
        self.tried = True
        env = {k: v for k, v in os.environ.items() if k != "TORCHTOP"}  # no agent in the relay
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "torchtop.monitor.relay", "--job", ident.job_id],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # the user's Ctrl-C goes to the job; the relay sees its ranks go
                close_fds=True,
            )
            atexit.register(self._leave_running)
        except Exception:  # broad: no relay on any failure: monitors reach the ranks one by one
            self.proc = None  # no relay: monitors reach this node's ranks one by one, as before

    def _leave_running(self) -> None:
        """At exit: the relay outlives this rank on purpose (it ends once the job's ranks on the
        node are gone), so its Popen is marked done: no "subprocess is still running" warning."""
        proc = self.proc
        if proc is not None and proc.returncode is None:
            proc.returncode = 0
