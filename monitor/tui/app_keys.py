"""The dashboard's keys, a base of TorchtopApp (app.py): leave, or interrupt the job; scroll the
tab on screen whatever has the focus (`scroll`: a widget moved by a key's name, the job view's
Ranks tab's too); help; switch tabs. Which keys apply where is TorchtopApp.check_action's."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from textual.widgets import TabbedContent
from textual.widgets._toast import ToastHolder

from torchtop.monitor.tui import bindings
from torchtop.monitor.tui.widgets import HelpScreen

if TYPE_CHECKING:
    from textual.app import App

    from torchtop.monitor.tui.widgets import LogTail, StatusLine

    _Base = App[Any]
else:
    _Base = object

SCROLLERS = {"overview": "#overview-scroll", "memory": "#memory-scroll", "gpu-host": "#gpu-host-scroll"}


def scroll(target: Any, key: str) -> None:
    """Move a scrolling widget as the key named `key` asks (up, down, pageup, pagedown, home, end)."""
    move = {
        "up": target.scroll_up,
        "down": target.scroll_down,
        "pageup": target.scroll_page_up,
        "pagedown": target.scroll_page_down,
        "home": target.scroll_home,
        "end": target.scroll_end,
    }.get(key)
    if move is not None:
        move(animate=False)


TOAST_S = 6.0  # longest a toast stays: the Captures screen (c) and the help (?) keep the details


class AppKeys(_Base):
    """TorchtopApp's key actions; `leaving` and `log_tail` are the app's."""

    leaving: bindings.Leaving
    log_tail: LogTail | None
    status_line: StatusLine

    def notify(
        self,
        message: str,
        *,
        title: str = "",
        severity: Any = "information",
        timeout: float | None = None,
        markup: bool = True,
    ) -> None:
        """One toast at a time, and brief: a stack of toasts would reach down over the verdict."""
        self.call_later(self._clear_toasts)  # queued before super's Notify: the older go first
        timeout = TOAST_S if timeout is None else min(timeout, TOAST_S)
        super().notify(message, title=title, severity=severity, timeout=timeout, markup=markup)

    def _clear_toasts(self) -> None:
        self.clear_notifications()
        self.screen.query(ToastHolder).remove()  # holder and toast: a holder left alone is a blank row

    def _tab(self) -> str:
        return self.query_one("#tabs", TabbedContent).active if self.is_mounted else "overview"

    def action_leave(self, _mode: str) -> None:
        self.exit(0)  # `torchtop demo` stops its job once the TUI is closed; attach and run do not

    def action_interrupt(self, _mode: str) -> None:
        if self.leaving.stop_job is not None:
            try:
                self.leaving.stop_job()
            except Exception as exc:  # broad: the job may be gone already: say so, and stay
                self.notify(f"could not signal the job: {exc}", severity="error", timeout=10)
                return
        self.exit(0)

    def action_scroll(self, key: str) -> None:
        """Scroll the tab on screen, whichever widget has the focus (the tab bar, after a click)."""
        if len(self.screen_stack) > 1:
            return  # help, captures, chooser: their own widgets scroll
        tab = self._tab()
        target = self.log_tail if tab == "log" else self.query_one(SCROLLERS.get(tab, "#overview-scroll"))
        if target is None:
            return
        scroll(target, key)

    def action_help(self) -> None:
        if isinstance(self.screen, HelpScreen):
            self.screen.dismiss(None)
        else:
            self.push_screen(HelpScreen(self.error_rows() + bindings.help_rows(self.check_action)))

    def error_rows(self) -> list[tuple[str, str]]:
        """The status line's last error, whole (the line clips it at the terminal's width)."""
        error = self.status_line.error
        return [("last error", " ".join(error.split()))] if error else []

    def action_tab(self, tab: str) -> None:
        self.query_one("#tabs", TabbedContent).active = tab
