"""The key bar at the bottom: one line at any width. Keys that do not fit are dropped, the least
needed first (PRIORITY), never cut mid-word; the help (?) names them all."""

from __future__ import annotations

from textual import events
from textual.actions import parse as parse_action
from textual.app import ComposeResult
from textual.widgets import Footer
from textual.widgets._footer import FooterKey

#: Actions by how much the bar needs them, most first; an action not named here comes last.
PRIORITY = (
    "close",
    "leave",
    "help",
    "interrupt",
    "refresh_list",
    "pause",
    "show_job",
    "slowest",
    "profile",
    "captures",
    "jump",
    "speed",
    "memory_snapshot",
)


def fitting(keys: list[tuple[str, int]], width: int) -> set[int]:
    """The indices of `keys` ((action, cells it takes)) that fit in `width`, by PRIORITY."""
    order = sorted(
        range(len(keys)),
        key=lambda k: (PRIORITY.index(keys[k][0]) if keys[k][0] in PRIORITY else len(PRIORITY), k),
    )
    kept: set[int] = set()
    used = 0
    for k in order:
        if used + keys[k][1] <= width:
            kept.add(k)
            used += keys[k][1]
    return kept


class KeyBar(Footer):
    """A compact Footer whose keys fit the terminal's width."""

    def __init__(self) -> None:
        super().__init__(compact=True)
        self._width = 0

    def compose(self) -> ComposeResult:
        if not self._bindings_ready:
            return
        shown: dict[str, tuple[str, str, str, bool, str]] = {}  # one key an action, the first bound
        for _, binding, enabled, tooltip in self.screen.active_bindings.values():
            if binding.show and binding.action not in shown:
                display = self.app.get_key_display(binding)
                shown[binding.action] = (binding.key, display, binding.description, enabled, tooltip)
        entries = list(shown.items())
        cells = [(parse_action(a)[1], len(d) + 1 + len(desc) + 1) for a, (_, d, desc, _, _) in entries]
        self._width = self.app.size.width
        kept = fitting(cells, self._width or 10_000)
        for k, (action, (key, display, description, enabled, tooltip)) in enumerate(entries):
            if k in kept:
                yield FooterKey(
                    key, display, description, action, disabled=not enabled, tooltip=tooltip
                ).data_bind(compact=Footer.compact)

    def on_resize(self, _event: events.Resize) -> None:
        if self.app.size.width != self._width:
            self.call_after_refresh(self.recompose)

    def plain(self) -> str:
        """The keys as shown, one line."""
        return " ".join(f"{k.key_display} {k.description}".strip() for k in self.query(FooterKey))
