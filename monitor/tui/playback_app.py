"""`torchtop replay FILE`: the live TUI's panels over a recording, at a chosen speed.

The app is the live one (TorchtopApp, no feed worker); a 10 Hz timer moves the replay's
position on the recording's clock by 0.1 s x speed and applies the messages passed, within a
time budget a tick (a fast run at high speed then plays slower than asked rather than freeze the
terminal; the status line shows where it really is). A seek starts afresh LEAD_S before its
target (model/playback.py), so every panel's window is full when it arrives.
"""

from __future__ import annotations

import time

from textual.binding import Binding

from torchtop.monitor.model import fmt
from torchtop.monitor.model.log_replay import LogReplay
from torchtop.monitor.model.playback import LEAD_S, Playback, apply, parse_when
from torchtop.monitor.model.state import RunState
from torchtop.monitor.tui.app import TorchtopApp
from torchtop.monitor.tui.transport import Transport

PLAY_S = 0.1  # the replay timer's period
APPLY_BUDGET_S = 0.04  # most of a tick spent applying messages
SEEK_S = 10.0
SEEK_LONG_S = 60.0


def clock(seconds: float) -> str:
    """1:02:03 / 2:03 from seconds."""
    seconds = max(0, int(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def jump_target(playback: Playback, text: str, position: float) -> float:
    """The recording time a jump goes to: "#N" or "step N" (the agent's step count), "+10s" /
    "-1:00" (relative), else a time into the recording ("90", "1:30"). ValueError otherwise."""
    text = text.strip().lower()
    if text.startswith("#") or text.startswith("step"):
        return playback.time_of_step(int(text.lstrip("#").removeprefix("step").strip()))
    if text[:1] in "+-":
        return position + (1 if text[0] == "+" else -1) * parse_when(text[1:])
    return playback.start + parse_when(text)


CAPTURE_ACTIONS = ("profile", "memory_snapshot")  # a recording takes no capture


class PlaybackApp(Transport, TorchtopApp):
    """The dashboard over a recording: space pauses, [ ] change speed, ← → seek, g jumps."""

    BINDINGS = [
        *[b for b in TorchtopApp.BINDINGS if not (isinstance(b, Binding) and b.action in CAPTURE_ACTIONS)],
        Binding("space", "pause", "Pause"),
        Binding("right_square_bracket", "speed(1)", "Faster"),
        Binding("left_square_bracket", "speed(-1)", "Slower"),
        Binding("right", f"seek({SEEK_S})", "+10s", show=False),
        Binding("left", f"seek({-SEEK_S})", "-10s", show=False),
        Binding("shift+right", f"seek({SEEK_LONG_S})", "+60s", show=False),
        Binding("shift+left", f"seek({-SEEK_LONG_S})", "-60s", show=False),
        Binding("home", "seek_to('start')", "Start", show=False),
        Binding("end", "seek_to('end')", "End", show=False),
        Binding("g", "jump", "Jump"),
        Binding("p", "captures", show=False),  # said in one line: a replay takes no captures
        Binding("m", "captures", show=False),
    ]

    def __init__(self, playback: Playback, speed: float = 1.0, at: float | None = None) -> None:
        super().__init__(None, None, feed=False)
        self.playback = playback
        self.speed = speed
        self.paused = False
        self.position = playback.start
        self._next = 0  # the next message to apply
        self._replay = LogReplay()
        self._start_at = at

    def on_mount(self) -> None:
        super().on_mount()
        self.header.target = f"replay of {self.playback.recording.directory}"
        self.capture_line.display = False  # its keys take captures of a live run: not here
        for line in self.playback.warnings:
            self.notify(line, title="recording damaged", severity="warning", timeout=15)
        self.set_interval(PLAY_S, self._play)
        if self._start_at is not None:
            self.seek(self._start_at)

    # -- playing -------------------------------------------------------------------------------
    def _play(self) -> None:
        if self.paused:
            return
        target = min(self.position + PLAY_S * self.speed, self.playback.end)
        self._apply_until(target, APPLY_BUDGET_S)
        if self._next >= len(self.playback.messages):
            self.paused = True  # the end: stays on the last frame
            self.position = self.playback.end
        self._refresh_status()

    def _apply_until(self, t: float, budget: float | None) -> None:
        """Apply the messages up to time `t`, within `budget` seconds (None: all of them)."""
        pb = self.playback
        stop = pb.index_at(t)
        started = time.perf_counter()
        while self._next < stop:
            end = min(stop, self._next + 8)  # a few at a time, then look at the clock
            apply(self.state, pb.play(self._next, end, self._replay))
            self._next = end
            if budget is not None and time.perf_counter() - started > budget:
                self.position = pb.times[self._next - 1]
                self._dirty = True
                return
        self.position = t
        self._dirty = True

    def seek(self, t: float) -> None:
        """Start afresh LEAD_S before `t` and apply everything up to it."""
        pb = self.playback
        t = min(max(t, pb.start), pb.end)
        self.state = RunState()
        self.diagnosis = None
        self._replay = LogReplay()
        self._next = max(0, pb.index_at(t - LEAD_S) - 1)
        self.position = pb.times[self._next] if pb.times else t
        self._apply_until(t, None)
        self.position = t
        self.refresh_panels()

    # -- keys ----------------------------------------------------------------------------------
    def span(self) -> tuple[float, float]:
        return self.playback.start, self.playback.end

    def at_end(self) -> bool:
        return self._next >= len(self.playback.messages)

    def jump_target(self, text: str) -> float:
        return jump_target(self.playback, text, self.position)

    def action_captures(self) -> None:
        self.notify("a replay: captures are taken on a live run (torchtop attach)", timeout=5)

    # -- status --------------------------------------------------------------------------------
    def replay_text(self) -> str:
        pb = self.playback
        state = "⏸ paused" if self.paused else "▶"
        return (
            f"replay {clock(self.position - pb.start)} / {clock(pb.end - pb.start)}  ×{self.speed:g} {state}"
            f"  steps {fmt.count(pb.step_counts[self._next - 1] if self._next else 0)}"
            f" / {fmt.count(pb.steps_total)}"
        )

    def _refresh_status(self) -> None:
        super()._refresh_status()
        self.status_line.connection = self.replay_text()
