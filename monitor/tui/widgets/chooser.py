"""The chooser shown when several local agents run: pick one to attach to."""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.screen import Screen
from textual.widgets import Footer, OptionList, Static

from torchtop.monitor.link.targets import describe


class ChooserScreen(Screen[int]):
    """Dismisses with the index of the chosen agent in `choices`."""

    def __init__(self, choices: list[dict[str, Any]]) -> None:
        super().__init__()
        self.choices = choices

    def compose(self) -> ComposeResult:
        with Vertical(id="chooser-box"):
            yield Static(
                f"{len(self.choices)} torchtop agents are running here; pick one (↑ ↓ enter):",
                id="chooser-title",
            )
            yield OptionList(*(describe(info) for info in self.choices), id="chooser-list")
        yield Footer()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option_index)
