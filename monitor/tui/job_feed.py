"""The job view's link to every rank: a loop for a Textual thread worker, and its message.

Like feed.py for one agent, but over a JobLink (link/job_link.py): it never touches the JobState or a
widget; it posts what the link saw, batched per poll, and the app applies it on its own thread.
Requests from the app (captures) arrive on a queue with the members they are for.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from textual.message import Message

from torchtop.monitor.link.job_link import Event, JobLink

POLL_S = 0.25  # also how often `cancelled()` is checked

JobRequest = tuple[str, dict[str, Any], list[str] | None]  # (cmd, args, member keys or all)


@dataclass
class JobEvents(Message):
    """What the link saw since the last poll: hellos, snapshots, batches, errors, replies."""

    events: list[Event]


@dataclass
class JobFeedError(Message):
    error: str


def run_job_feed(
    link: JobLink,
    post: Callable[[Message], object],
    cancelled: Callable[[], bool],
    requests: queue.SimpleQueue[JobRequest] | None = None,
) -> None:
    """Poll the link until `cancelled()`; never raises (a bug shows in the status line)."""
    try:
        while not cancelled():
            while requests is not None:
                try:
                    cmd, args, keys = requests.get_nowait()
                except queue.Empty:
                    break
                link.request(cmd, args, keys)
            events = link.poll(POLL_S)
            if events:
                post(JobEvents(events))
    except Exception as exc:  # broad: a feed bug must show in the status line, not kill the TUI
        post(JobFeedError(f"job feed stopped: {type(exc).__name__}: {exc}"))
    finally:
        link.close()
