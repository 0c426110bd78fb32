"""The `?` screen: the keys, and what the panels measure (so nobody has to guess)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static

HELP = """\
[b]Keys[/b]
  [b]q[/b]        quit (training goes on)
  [b]?[/b]        this help
  [b]escape[/b]   close this help

[b]Panels[/b]
  [b]step time[/b]   now / median / p90 of the training steps that ended
              in the last 10 s of the agent's clock, and steps per second
  [b]phases[/b]      host time per step in data (dataloader wait), h2d
              (host-to-device copies), forward, backward, optimizer and
              other (the rest of the step); device ms are CUDA-event
              times on sampled steps
  [b]status[/b]      gaps: batches lost between agent and monitor;
              dropped: step records the agent's buffer dropped"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [
        Binding("escape", "close", "Close"),
        Binding("question_mark", "close", "Close"),
    ]

    def compose(self) -> ComposeResult:
        with Vertical(id="help-box"):
            yield Static(HELP, id="help-text")

    def on_mount(self) -> None:
        self.query_one("#help-box").border_title = "torchtop help"

    def action_close(self) -> None:
        self.dismiss(None)
