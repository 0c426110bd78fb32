"""The TUI's keys: one table that the app binds, the footer shows and the help screen lists.

What `q` and Ctrl-C do depends on how the TUI was opened (`Leaving`): attached to a run, they
only close the monitor; under `torchtop demo` they also stop the demo, a job that runs only to
be watched; under `torchtop run`, q leaves the job running (the launcher waits for it) and
Ctrl-C stops it, as Ctrl-C in the terminal would have without the TUI (the TUI holds the
terminal in raw mode, so no SIGINT reaches anyone unless the launcher's callback sends it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple

from textual.actions import parse as parse_action
from textual.binding import Binding

LeaveMode = Literal["attach", "demo", "run"]


@dataclass(frozen=True)
class Leaving:
    """How the TUI was opened, and for `run` how to signal the job (the launcher's callback)."""

    mode: LeaveMode = "attach"
    stop_job: Callable[[], None] | None = None


class QuitWords(NamedTuple):
    q_label: str  # the footer's word for q
    q_help: str
    ctrl_c_label: str  # "" keeps Ctrl-C out of the footer
    ctrl_c_help: str


QUIT_WORDS: dict[LeaveMode, QuitWords] = {
    "attach": QuitWords("Quit", "quit; the training run goes on", "", "quit, as q: the run goes on"),
    "demo": QuitWords(
        "Quit+stop demo",
        "quit and stop the demo job (it runs only to be watched)",
        "",
        "quit and stop the demo, as q",
    ),
    "run": QuitWords(
        "Quit (job goes on)",
        "quit the TUI; the job goes on and `torchtop run` waits for it (Ctrl-C there stops it)",
        "Stop job",
        "stop the job (SIGINT to it, as Ctrl-C in a terminal) and quit",
    ),
}

#: (key, tab id, what the tab shows); the app binds the keys of the tabs it has.
TABS: tuple[tuple[str, str, str], ...] = (
    ("1", "overview", "overview"),
    ("2", "memory", "memory"),
    ("3", "gpu-host", "GPU and host"),
    ("4", "log", "the job's output"),
)

#: (key, its name in the help) of the keys that scroll the tab on screen.
SCROLL_KEYS: tuple[tuple[str, str], ...] = (
    ("up", "↑"),
    ("down", "↓"),
    ("pageup", "PgUp"),
    ("pagedown", "PgDn"),
    ("home", ""),  # named in the words of the help's scroll row
    ("end", ""),
)


def _bindings() -> list[Binding]:
    out: list[Binding] = []
    for mode, words in QUIT_WORDS.items():  # one of each pair is enabled (TorchtopApp.check_action)
        out.append(Binding("q", f"leave('{mode}')", words.q_label, tooltip=words.q_help))
        out.append(
            Binding(
                "ctrl+c",
                f"interrupt('{mode}')",
                words.ctrl_c_label,
                show=bool(words.ctrl_c_label),
                key_display="^c",
                priority=True,  # before Textual's own "press ctrl+q to quit" notice
                tooltip=words.ctrl_c_help,
            )
        )
    out += [Binding(key, f"tab('{tab}')", words, show=False, tooltip=words) for key, tab, words in TABS]
    out += [
        Binding(key, f"scroll('{key}')", show=False, tooltip="scroll the tab") for key, name in SCROLL_KEYS
    ]
    out += [
        Binding(
            "question_mark", "help", "Help", key_display="?", tooltip="this help (? or escape closes it)"
        ),
        Binding(
            "p", "profile", "Profile", tooltip="profile the next N steps (a torch.profiler trace, .json.gz)"
        ),
        Binding(
            "plus,equals_sign",
            "steps(1)",
            show=False,
            key_display="+",
            tooltip="N + 1 (default 5, at most 100)",
        ),
        Binding("minus", "steps(-1)", show=False, key_display="-", tooltip="N - 1"),
        Binding(
            "m",
            "memory_snapshot",
            "Mem snapshot",
            tooltip="CUDA memory snapshot of the next N steps (a pickle for pytorch.org/memory_viz)",
        ),
        Binding(
            "c", "captures", "Captures", tooltip="captures: past traces and snapshots, summaries, file paths"
        ),
    ]
    return out


BINDINGS = _bindings()


def help_rows(enabled: Callable[[str, tuple[object, ...]], bool | None]) -> list[tuple[str, str]]:
    """(keys, what they do) for the help screen, from the bindings `enabled` allows: the tabs,
    the scroll keys and + - each on one row, so the help names exactly this TUI's keys."""
    rows: list[tuple[str, str]] = []
    grouped: dict[str, list[tuple[str, str]]] = {"tab": [], "scroll": [], "steps": []}
    for b in BINDINGS:
        _, name, params = parse_action(b.action)
        if enabled(name, params) is False:
            continue
        shown = "ctrl+c" if name == "interrupt" else b.key_display or b.key
        if name == "scroll":
            shown = dict(SCROLL_KEYS)[b.key] or b.key  # home, end: named in the row's words
        if name in grouped:
            if not grouped[name]:
                rows.append((name, ""))  # where the group's row goes
            grouped[name].append((shown, b.tooltip))
        else:
            rows.append((shown, b.tooltip))
    words = {
        "tab": "tabs: " + " · ".join(w for _, w in grouped["tab"]),
        "scroll": "scroll the tab"
        + (", also Home and End" if {"home", "end"} & {k for k, _ in grouped["scroll"]} else "")
        + " (a small terminal scrolls the overview)",
        "steps": "change N (default 5, at most 100)",
    }
    return [
        (" ".join(k for k, _ in grouped[key] if k not in ("home", "end")), words[key])
        if not text and key in grouped
        else (key, text)
        for key, text in rows
    ]
