"""The chooser shown when several local agents run: pick one to attach to."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.screen import Screen
from textual.widgets import Footer, OptionList, Static

from torchtop.contract.discovery import AgentInfo
from torchtop.monitor.link.targets import describe


def choice_rows(choices: list[AgentInfo]) -> list[tuple[str, int]]:
    """(row, index in `choices`) for each agent, one row per process: an entry listed twice
    (the same pid and start) shows once; every row names its pid, so no two rows read alike."""
    rows: list[tuple[str, int]] = []
    seen: set[tuple[int | None, float | None]] = set()
    for k, info in enumerate(choices):
        key = (info.pid, info.start_time)
        if key in seen:
            continue
        seen.add(key)
        rows.append((describe(info), k))
    return rows


class ChooserScreen(Screen[int]):
    """Dismisses with the index of the chosen agent in `choices`."""

    def __init__(self, choices: list[AgentInfo]) -> None:
        super().__init__()
        self.choices = choices
        self.rows = choice_rows(choices)

    def compose(self) -> ComposeResult:
        with Vertical(id="chooser-box"):
            yield Static(
                f"{len(self.rows)} torchtop agents are running here; pick one (↑ ↓ enter):",
                id="chooser-title",
            )
            yield OptionList(*(row for row, _ in self.rows), id="chooser-list")
        yield Footer()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(self.rows[event.option_index][1])
