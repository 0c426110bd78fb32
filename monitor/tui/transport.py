"""The playback keys a replay shares, one recording or a job's: pause, speed, seek, jump.

A mixin for the two replay apps (replay_app.py, job_replay_app.py): each says where its
recording starts and ends, whether its last message was applied, how to seek, and where a jump
typed as text goes; the keys work the same in both. JumpScreen is the `g` prompt both use.
"""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label

SPEEDS = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)


class JumpScreen(ModalScreen[str | None]):
    """Asks where to jump: a step or a time."""

    DEFAULT_CSS = """
    JumpScreen { align: center middle; }
    #jump-box { width: 72; max-width: 100%; height: auto; border: round $primary; padding: 0 1; background: $panel; }
    #jump-box Label { width: 100%; }
    """
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def compose(self) -> ComposeResult:
        with Vertical(id="jump-box"):
            yield Label("jump to #STEP, a time into the recording (90, 1:30) or +10s / -1:00")
            yield Input(placeholder="#1200  or  1:30", id="jump-input")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value)

    def action_cancel(self) -> None:
        self.dismiss(None)


class Transport:
    """Space, speed, seek and jump over a recording. The app supplies the three methods below,
    and `seek(t)` and `_refresh_status()` (not stubbed here: the apps' own call their parents')."""

    paused: bool
    speed: float
    position: float

    # -- what the app supplies -------------------------------------------------------------------
    def span(self) -> tuple[float, float]:  # the recording's first and last time
        raise NotImplementedError

    def at_end(self) -> bool:  # its last message was applied
        raise NotImplementedError

    def jump_target(self, text: str) -> float:  # ValueError when the text names no time
        raise NotImplementedError

    # -- the keys --------------------------------------------------------------------------------
    def action_pause(self) -> None:
        app: Any = self
        if self.paused and self.at_end():
            app.seek(self.span()[0])  # at the end: play again from the start
        self.paused = not self.paused
        app._refresh_status()

    def action_speed(self, direction: int) -> None:
        k = min(range(len(SPEEDS)), key=lambda i: abs(SPEEDS[i] - self.speed))
        self.speed = SPEEDS[max(0, min(len(SPEEDS) - 1, k + direction))]
        app: Any = self
        app._refresh_status()

    def action_seek(self, seconds: float) -> None:
        app: Any = self
        app.seek(self.position + seconds)

    def action_seek_to(self, where: str) -> None:
        start, end = self.span()
        app: Any = self
        app.seek(start if where == "start" else end)

    def action_jump(self) -> None:
        app: Any = self
        app.push_screen(JumpScreen(), self._jumped)

    def _jumped(self, text: str | None) -> None:
        if not text:
            return
        app: Any = self
        try:
            app.seek(self.jump_target(text))
        except ValueError:
            app.notify(f"cannot read {text!r}: try #1200, 90, 1:30 or +10s", severity="warning")
