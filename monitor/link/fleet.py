"""Many agents at once, headless: what `torchtop export` watches (a job's ranks, several nodes).

One AgentClient and one RunState per agent, all read from one thread through a single poll.
Each client replays a bounded sample of the steps (model/budget.py), so the CPU it takes and
the memory it holds do not grow with the step rate; counts and rates come from the agent's own
step counter. With `discover`, the local agents are listed again every few seconds, so ranks
that start later (or restart) are picked up; an agent that stops answering is marked down.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from torchtop.contract import wire
from torchtop.monitor.link.client import AgentClient, AgentUnreachable
from torchtop.monitor.link.targets import Endpoint, TargetError, from_discovery, local_agents
from torchtop.monitor.model.budget import StepBudget
from torchtop.monitor.model.job_state import JobState
from torchtop.monitor.model.state import HISTORY, RunState

REPLAY_STEPS_PER_S = (
    500.0  # per agent: every step of a >= 2 ms step, a sample of faster ones (stats need no more)
)
RESCAN_S = 5.0
HELLO_TIMEOUT_S = 1.0
SILENT_AFTER_S = 5.0  # no batch this long: ask for a hello; no answer: down


@dataclass
class Watched:
    endpoint: Endpoint
    client: AgentClient
    state: RunState = field(default_factory=RunState)
    hello: wire.Hello | None = None
    last_batch: float = 0.0
    up: bool = False
    retry_at: float = 0.0
    job: JobState | None = None  # the job it is a rank of (its hello's job id): judged as one

    def apply_batch(self, received: Any, now: float) -> None:
        if self.job is not None:  # the job's aggregate and rank figures, and this rank's state
            self.job.apply_batch(
                self.endpoint.address, received.batch, received.steps, now, received.log_errors
            )
        else:
            self.state.apply_batch(received.batch, received.steps, now, received.log_errors)

    @property
    def budget(self) -> StepBudget:
        assert self.client.budget is not None
        return self.client.budget


class Fleet:
    def __init__(
        self,
        endpoints: list[Endpoint] | None = None,
        discover: bool = False,
        replay_steps_per_s: float = REPLAY_STEPS_PER_S,
        ctx: Any = None,
    ) -> None:
        self.ctx = ctx or zmq.Context.instance()
        self.discover = discover
        self.replay_steps_per_s = replay_steps_per_s
        self.agents: dict[str, Watched] = {}
        self.jobs: dict[str, JobState] = {}  # job id -> its ranks, judged by the job rules
        self._rescan_at = 0.0
        self._pinned: set[str] = set()  # endpoints asked for by name: watched even while down
        for e in endpoints or []:
            self._pinned.add(self.add(e).endpoint.address)

    def add(self, endpoint: Endpoint) -> Watched:
        key = endpoint.address
        if key not in self.agents:
            client = AgentClient(endpoint, self.ctx)
            client.budget = StepBudget(self.replay_steps_per_s)
            self.agents[key] = Watched(endpoint, client)
        return self.agents[key]

    def close(self) -> None:
        for w in self.agents.values():
            w.client.close()

    # -- reading -------------------------------------------------------------------------------
    def poll(self, timeout: float) -> None:
        """Say hello where due, then read every batch that arrives within `timeout`."""
        now = time.monotonic()
        if self.discover and now >= self._rescan_at:
            self._rescan_at = now + RESCAN_S
            found: set[str] = set()
            for info in local_agents():
                try:
                    found.add(self.add(from_discovery(info)).endpoint.address)
                except TargetError:
                    continue  # an entry that cannot be used (`torchtop ls` says why): never the exporter's end
            for key in [k for k, w in self.agents.items() if k not in found | self._pinned and not w.up]:
                gone = self.agents.pop(key)  # a run that ended: its series go stale
                gone.client.close()
                if gone.job is not None:
                    gone.job.lost(key, "the agent ended")
        for w in self.agents.values():
            if (not w.up or now - w.last_batch > SILENT_AFTER_S) and now >= w.retry_at:
                self._greet(w, now)
        poller = zmq.Poller()
        socks = {}
        for w in self.agents.values():
            poller.register(w.client.sub, zmq.POLLIN)
            socks[w.client.sub] = w
        for sock, _ in poller.poll(int(timeout * 1000)):
            w = socks[sock]
            got = w.client.recv_batches(0)
            stamp = time.monotonic()
            for r in got:
                w.apply_batch(r, stamp)
            if got:
                w.last_batch, w.up = stamp, True
            w.state.bad_frames = w.client.bad_frames

    def _greet(self, w: Watched, now: float) -> None:
        try:
            hello = w.client.hello(timeout=HELLO_TIMEOUT_S)
        except AgentUnreachable as exc:
            w.up = False
            w.state.gone = w.hello is not None
            w.retry_at = now + RESCAN_S
            if w.job is not None and w.hello is not None:
                w.job.lost(w.endpoint.address, str(exc))
            return
        w.hello, w.up, w.last_batch = hello, True, time.monotonic()
        if hello.job_id and w.job is None:
            # each rank keeps as many steps as an agent on its own (the exporter's window)
            w.job = self.jobs.setdefault(hello.job_id, JobState(hello.job_id, member_history=HISTORY))
            w.state = w.job.member(w.endpoint.address).state
        if w.job is not None:
            w.job.apply_hello(w.endpoint.address, hello)
        else:
            w.state.apply_hello(hello)
