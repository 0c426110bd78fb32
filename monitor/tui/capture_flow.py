"""The TUI's captures: the p / m / + - / c keys, the agent's answers, and the Captures screen.

A base of TorchtopApp (its one job: captures), so app.py keeps the panels and the feed. Requests
go to the feed worker through `requests`; answers and progress come back as messages and batch
fields, and end up in `captures` (a pure CaptureBook) and on screen.
"""

from __future__ import annotations

import queue
from typing import Any

from textual.app import App

from torchtop.contract.request_commands import Command
from torchtop.contract.wire import Batch, CaptureKind, CaptureState
from torchtop.monitor.link.targets import Endpoint
from torchtop.monitor.model.captures import (
    CaptureBook,
    capture_lines,
    fetch_from,
    next_steps,
    progress_text,
    toast_text,
)
from torchtop.monitor.tui.feed import RequestAnswered
from torchtop.monitor.tui.widgets import CapturesScreen


class CaptureApp(App[int]):
    captures: CaptureBook
    capture_steps: int
    requests: queue.SimpleQueue[tuple[str, dict[str, Any]]]  # to the feed worker
    endpoint: Endpoint | None

    def _refresh_status(self) -> None:
        raise NotImplementedError  # TorchtopApp's: the status and capture lines

    def ask(self, cmd: str, args: dict[str, Any] | None = None) -> None:
        """Queue a request for the feed worker; the answer comes back as RequestAnswered."""
        self.requests.put((cmd, args or {}))

    def _capture_seen(self, batch: Batch) -> None:
        if batch.capture is None or batch.capture == self.captures.current:
            return  # most batches: nothing new about captures
        finished = self.captures.see(batch.capture)
        if finished is not None:
            if finished.state == CaptureState.DONE:
                self.notify(toast_text(finished), title="capture done", timeout=10)
            else:
                self.notify(toast_text(finished), title="capture failed", severity="error", timeout=10)
            self.ask(Command.CAPTURE_STATUS)  # the list (and the Captures screen) with its summary
        if isinstance(self.screen, CapturesScreen):
            self._refresh_captures()

    def on_request_answered(self, message: RequestAnswered) -> None:
        reply = message.reply
        if reply is None:
            self.notify(message.error, title=f"{message.cmd}: no answer", severity="error", timeout=8)
            return
        if message.cmd == Command.CAPTURE_STATUS:
            if reply.ok:
                self.captures.merge(reply.captures)
        elif reply.ok:
            self.captures.requested(reply.capture)
            if reply.capture is not None:
                self.notify(progress_text(reply.capture), title="capture requested")
        else:
            what = "profile" if message.cmd == f"capture-{CaptureKind.PROFILE}" else "memory snapshot"
            self.notify(reply.error, title=f"{what} refused", severity="warning", timeout=10)
        self._refresh_captures()

    def on_captures_screen_refresh_wanted(self, _message: CapturesScreen.RefreshWanted) -> None:
        self.ask(Command.CAPTURE_STATUS)

    def _refresh_captures(self) -> None:
        self._refresh_status()
        screen = self.screen
        if not isinstance(screen, CapturesScreen):
            return
        label, host = (str(self.endpoint), self.endpoint.host) if self.endpoint else ("", "")
        screen.entries = [capture_lines(c, fetch_from(label, host, c.host)) for c in self.captures.listing()]
        active = self.captures.active
        screen.note = progress_text(active) if active is not None else ""

    def action_profile(self) -> None:
        self.ask(Command.CAPTURE_PROFILE, {"steps": self.capture_steps})

    def action_memory_snapshot(self) -> None:
        self.ask(Command.CAPTURE_MEMORY, {"steps": self.capture_steps})

    def action_steps(self, direction: int) -> None:
        self.capture_steps = next_steps(self.capture_steps, direction > 0)
        self._refresh_status()

    def action_captures(self) -> None:
        if not isinstance(self.screen, CapturesScreen):
            self.push_screen(CapturesScreen())
            self.call_after_refresh(self._refresh_captures)
