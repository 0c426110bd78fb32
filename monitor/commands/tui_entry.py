"""Opening the TUI from a command, and the one line it prints when the TUI is not installed.

An agent-only install (`pip install torchtop`, without the [tui] extra) has no textual, rich or
plotext: the agent and the headless commands (ls, report, capture, compare, trace, keys,
run/demo --no-tui) work, and the commands that open a TUI (attach, demo, run, replay) say what
to install instead of a traceback.
"""

from __future__ import annotations

TUI_PACKAGES = frozenset({"textual", "rich", "textual_plotext", "plotext"})
EXIT_NO_TUI = 2
TUI_MISSING = (
    "the TUI needs the full install: pip install 'torchtop[tui]' (this install has the agent and "
    "the headless commands: ls, report, capture, run --no-tui, demo --no-tui)"
)


class TuiMissing(Exception):
    """The TUI's packages are not installed; the message says what to install."""


def require_tui() -> None:
    """TuiMissing when the TUI's packages are absent (other import errors rise as they are).
    It imports the TUI, so the caller's `from torchtop.monitor.tui.app import run_tui` is free."""
    try:
        import torchtop.monitor.tui.app  # noqa: F401
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] in TUI_PACKAGES:
            raise TuiMissing(f"{TUI_MISSING}; missing: {exc.name}") from None
        raise
