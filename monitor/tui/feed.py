"""The TUI's link to one agent: a loop for a Textual thread worker, and the messages it posts.

The loop owns the (synchronous) AgentClient and never touches RunState or widgets: it posts
messages up to the app, which applies them on its own thread. It checks `cancelled()` at least
every second (short poll and request timeouts), so the app exits promptly, and it keeps
retrying an agent that does not answer, so a restarted agent is picked up.

Requests from the app (captures) arrive on a thread-safe queue that the loop drains between
stream reads: the AgentClient is not thread-safe, so only this loop ever touches it.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from textual.message import Message

from torchtop.contract import wire
from torchtop.monitor.link.client import AgentClient, AgentUnreachable, Received
from torchtop.monitor.link.record import MonitorRecorder
from torchtop.monitor.link.targets import Endpoint
from torchtop.monitor.model.steps import StepRecord

POLL_S = 0.25  # recv_batches timeout: also how often `cancelled()` is checked
HELLO_TIMEOUT_S = 1.0  # short, so quitting never waits long on a dead agent
SNAPSHOT_TIMEOUT_S = 2.0
RETRY_PAUSE_S = 0.5  # between hellos to an agent that does not answer
SILENT_AFTER_S = 3.0  # no batch for this long: ask for a hello to tell "stale" from "gone"
REQUEST_TIMEOUT_S = 2.0  # an app request (capture, capture-status): short, the stream waits meanwhile


@dataclass
class HelloReceived(Message):
    """The agent answered a hello (first contact, or again after it was lost)."""

    hello: wire.Hello


@dataclass
class SnapshotReceived(Message):
    """Recent history from before we joined; batches up to `seq` are already in it."""

    steps: list[StepRecord]
    seq: int
    tally: wire.StepTally | None = None  # the agent's count of every step of the run
    wall_offset: float = 0.0
    memory: list[wire.MemoryLow] = field(default_factory=list)  # the agent's per-second memory lows


@dataclass
class BatchesReceived(Message):
    """Batches off the stream with their replayed steps, and the client's cumulative bad-frame count."""

    batches: list[Received]
    bad_frames: int = 0
    last_error: str = ""


@dataclass
class FeedError(Message):
    """The agent does not answer; `lost` when it had answered before (the agent is gone)."""

    error: str
    lost: bool = False


@dataclass
class RequestAnswered(Message):
    """The agent's reply to a request the app queued; `reply` is None when there was none (`error`)."""

    cmd: str
    args: dict[str, Any]
    reply: wire.Reply | None
    error: str = ""


def run_feed(
    endpoint: Endpoint,
    post: Callable[[Message], object],
    cancelled: Callable[[], bool],
    client_factory: Callable[[Endpoint], AgentClient] = AgentClient,
    requests: queue.SimpleQueue[tuple[str, dict[str, Any]]] | None = None,
    recorder: MonitorRecorder | None = None,
) -> None:
    """Hello (retrying), snapshot, then stream batches until `cancelled()`; never raises.

    Between stream reads it sends the requests queued on `requests` and posts each answer.
    With `recorder`, what it receives is also written to a recording (`attach --record`).
    """
    client: AgentClient | None = None
    try:
        client = client_factory(endpoint)
        _loop(client, post, cancelled, requests, recorder)
    except Exception as exc:  # broad: a feed bug must show in the status line, not kill the TUI
        post(FeedError(f"feed stopped: {type(exc).__name__}: {exc}"))
    finally:
        if client is not None:
            client.close()
        if recorder is not None:
            recorder.close()


def _sleep(seconds: float, cancelled: Callable[[], bool]) -> None:
    end = time.monotonic() + seconds
    while not cancelled() and (left := end - time.monotonic()) > 0:
        time.sleep(min(left, 0.1))


def serve_requests(
    client: AgentClient,
    requests: queue.SimpleQueue[tuple[str, dict[str, Any]]] | None,
    post: Callable[[Message], object],
    connected: bool,
) -> None:
    """Send every queued request (answering each with a RequestAnswered); never raises."""
    while requests is not None:
        try:
            cmd, args = requests.get_nowait()
        except queue.Empty:
            return
        if not connected:
            post(RequestAnswered(cmd, args, None, "not connected to an agent"))
            continue
        try:
            post(RequestAnswered(cmd, args, client.request(cmd, args, timeout=REQUEST_TIMEOUT_S)))
        except AgentUnreachable as exc:
            post(RequestAnswered(cmd, args, None, str(exc)))


def _loop(
    client: AgentClient,
    post: Callable[[Message], object],
    cancelled: Callable[[], bool],
    requests: queue.SimpleQueue[tuple[str, dict[str, Any]]] | None = None,
    recorder: MonitorRecorder | None = None,
) -> None:
    connected = False
    record_error = ""
    ever_connected = False
    last_batch = time.monotonic()
    bad_seen = 0
    while not cancelled():
        if not connected:
            try:
                hello = client.hello(timeout=HELLO_TIMEOUT_S)
            except AgentUnreachable as exc:
                post(FeedError(str(exc), lost=ever_connected))
                serve_requests(client, requests, post, connected=False)
                _sleep(RETRY_PAUSE_S, cancelled)
                continue
            post(HelloReceived(hello))
            if recorder is not None:
                recorder.hello(hello)
            connected = ever_connected = True
            last_batch = time.monotonic()
            try:
                reply, steps = client.snapshot(timeout=SNAPSHOT_TIMEOUT_S)
                if reply.ok:
                    post(
                        SnapshotReceived(steps, reply.seq, reply.tally, reply.wall_offset, list(reply.memory))
                    )
                    if recorder is not None:
                        recorder.snapshot(reply)
            except AgentUnreachable:
                pass  # live batches still come; only the history before we joined is missing
        serve_requests(client, requests, post, connected=True)
        batches = client.recv_batches(POLL_S)
        if recorder is not None:
            for got in batches:
                recorder.batch(got.batch)
            said = recorder.error or recorder.note  # stopped, or not where asked: said once
            if said and said != record_error:
                record_error = said
                post(FeedError(record_error))
        now = time.monotonic()
        if batches or client.bad_frames != bad_seen:
            bad_seen = client.bad_frames
            post(BatchesReceived(batches, client.bad_frames, client.last_error))
        if batches:
            last_batch = now
        elif now - last_batch > SILENT_AFTER_S:
            # The agent publishes ~10 batches/s, empty ones too: silence means trouble. Say
            # hello again: no answer means gone; an answer may be a new run on the same port.
            connected = False
