"""`torchtop replay DIR` of a job's recording: the job view (Ranks tab, the job's verdict, `[` `]`
to a rank) over every rank's recording, merged in time order (model/job_playback.py).

The live job view with no feed; a 10 Hz timer moves the position by 0.1 s x speed and applies
the messages passed, within a time budget a tick, as the one-rank replay does (replay_app.py).
`[` and `]` keep their job-view meaning (the previous / next rank), so `-` and `+` set the speed.
"""

from __future__ import annotations

import time

from textual.binding import Binding

from torchtop.monitor.model import fmt
from torchtop.monitor.model.job_playback import JobPlayback
from torchtop.monitor.model.log_replay import LogReplay
from torchtop.monitor.model.playback import LEAD_S, parse_when
from torchtop.monitor.tui.job_app import JobApp
from torchtop.monitor.tui.playback_app import (
    APPLY_BUDGET_S,
    CAPTURE_ACTIONS,
    PLAY_S,
    SEEK_LONG_S,
    SEEK_S,
    clock,
)
from torchtop.monitor.tui.transport import Transport


class JobReplayApp(Transport, JobApp):
    """The job view over a job's recording: space pauses, - + change speed, ← → seek, g jumps."""

    BINDINGS = [
        *[b for b in JobApp.BINDINGS if not (isinstance(b, Binding) and b.action in CAPTURE_ACTIONS)],
        Binding("p", "no_capture", show=False),
        Binding("m", "no_capture", show=False),
        Binding("space", "pause", "Pause"),
        Binding("plus,equals_sign", "speed(1)", "Faster", key_display="+"),
        Binding("minus", "speed(-1)", "Slower", key_display="-"),
        Binding("right", f"seek({SEEK_S})", "+10s", show=False),
        Binding("left", f"seek({-SEEK_S})", "-10s", show=False),
        Binding("shift+right", f"seek({SEEK_LONG_S})", "+60s", show=False),
        Binding("shift+left", f"seek({-SEEK_LONG_S})", "-60s", show=False),
        Binding("home", "seek_to('start')", "Start", show=False),
        Binding("end", "seek_to('end')", "End", show=False),
        Binding("g", "jump", "Jump"),
    ]

    def __init__(self, played: JobPlayback, speed: float = 1.0, at: float | None = None) -> None:
        super().__init__(None, feed=False)
        self.played = played
        self.job = played.new_job()
        self.state = self.job.job
        self.speed = speed
        self.paused = False
        self.position = played.start
        self._next = 0
        self._replays: dict[int, LogReplay] = {}
        self._start_at = at

    def on_mount(self) -> None:
        super().on_mount()
        self.capture_line.display = False  # its keys take captures of a live run: not here
        for line in self.played.warnings:
            self.notify(line, title="recording damaged", severity="warning", timeout=15)
        self.set_interval(PLAY_S, self._play)
        if self._start_at is not None:
            self.seek(self._start_at)

    # -- playing -------------------------------------------------------------------------------
    def _play(self) -> None:
        if self.paused:
            return
        self._apply_until(min(self.position + PLAY_S * self.speed, self.played.end), APPLY_BUDGET_S)
        if self._next >= len(self.played.order):
            self.paused = True
            self.position = self.played.end
        self._refresh_status()

    def _apply_until(self, t: float, budget: float | None) -> None:
        played = self.played
        stop = played.index_at(t)
        started = time.perf_counter()
        while self._next < stop:
            end = min(stop, self._next + 16)
            played.apply(self.job, self._next, end, self._replays)
            self._next = end
            if budget is not None and time.perf_counter() - started > budget:
                self.position = played.times[self._next - 1]
                self._dirty = True
                return
        self.position = t
        self._dirty = True

    def seek(self, t: float) -> None:
        played = self.played
        t = min(max(t, played.start), played.end)
        shown = self.shown_key
        self.job = played.new_job()
        self.job_diagnosis = self.diagnosis = None
        self._replays = {}
        self._next = max(0, played.index_at(t - LEAD_S) - 1)
        self._apply_until(t, None)
        self.position = t
        self.show_member(shown)  # the same rank (or the job) on the fresh state

    # -- keys ----------------------------------------------------------------------------------
    def span(self) -> tuple[float, float]:
        return self.played.start, self.played.end

    def at_end(self) -> bool:
        return self._next >= len(self.played.order)

    def jump_target(self, text: str) -> float:
        """#STEP (the lowest rank's step count), +10s / -1:00, or a time into the recording."""
        text = text.strip().lower()
        if text.startswith("#") or text.startswith("step"):
            first = self.played.ranks[min(self.played.ranks)]
            return first.time_of_step(int(text.lstrip("#").removeprefix("step").strip()))
        if text[:1] in "+-":
            return self.position + (1 if text[0] == "+" else -1) * parse_when(text[1:])
        return self.played.start + parse_when(text)

    def action_no_capture(self) -> None:
        self.notify("a replay: captures are taken on a live run (torchtop attach)", timeout=5)

    def action_captures(self) -> None:
        self.action_no_capture()

    # -- status --------------------------------------------------------------------------------
    def _refresh_status(self) -> None:
        super()._refresh_status()
        played = self.played
        state = "⏸ paused" if self.paused else "▶"
        steps = max((m.last_i for m in self.job.members.values()), default=-1) + 1
        self.status_line.connection = (
            f"replay of a {len(played.ranks)}-rank job {clock(self.position - played.start)} / "
            f"{clock(played.end - played.start)}  ×{self.speed:g} {state}  steps {fmt.count(steps)}"
        )
