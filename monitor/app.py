"""`torchtop attach`: the live TUI on one agent.

Messages up, attributes down: a thread worker (monitor/feed.py) owns the AgentClient and posts
messages; the app applies them to a pure RunState, and a ~4 Hz timer pushes plain values from
that state into the widgets' reactive attributes (never per batch: a 10 kHz loop must not
make the terminal the bottleneck). Never imports torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.widgets import Footer
from textual.worker import get_current_worker

from .feed import BatchesReceived, FeedError, HelloReceived, SnapshotReceived, run_feed
from .state import RunState, breakdown, device_ms, phase_ms, step_stats
from .targets import Endpoint, from_discovery
from .widgets import ChooserScreen, HelpScreen, PhasePanel, RunHeader, StatusLine, StepPanel

WINDOW_S = 10.0  # seconds of agent time the panels summarise
REFRESH_S = 0.25  # widget refresh period (4 Hz)
SPARK_POINTS = 2000  # most step times handed to the sparkline (it buckets them to its width)
MAX_CPU_SHARE = 0.05  # of one core, for recomputing the panels (see TorchtopApp._tick)


class TorchtopApp(App[int]):
    """The dashboard. `feed=False` starts no worker, so tests can post messages themselves;
    `clock` replaces time.monotonic (staleness), so snapshot tests render the same every time."""

    CSS_PATH = "app.tcss"
    TITLE = "torchtop"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("question_mark", "help", "Help", key_display="?"),
    ]

    def __init__(
        self,
        endpoint: Endpoint | None = None,
        choices: list[dict[str, Any]] | None = None,
        *,
        feed: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.endpoint = endpoint
        self.choices = choices or []
        self.feed_enabled = feed
        self.clock = clock
        self.state = RunState()
        self.feed_error = ""
        self._dirty = True  # new data since the panels were last recomputed
        self._next_full = 0.0  # perf_counter time before which _tick skips the recompute
        self.header = RunHeader(id="run-header")
        self.step_panel = StepPanel(WINDOW_S, id="step-panel")
        self.phase_panel = PhasePanel(id="phase-panel")
        self.status_line = StatusLine(id="status-line")

    def compose(self) -> ComposeResult:
        yield self.header
        with Vertical(id="panels"):
            yield self.step_panel
            yield self.phase_panel
        yield self.status_line
        yield Footer()

    def on_mount(self) -> None:
        self.set_interval(REFRESH_S, self._tick)
        if self.endpoint is not None:
            self.attach(self.endpoint)
        elif len(self.choices) == 1:
            self.attach(from_discovery(self.choices[0]))
        elif self.choices:
            self.push_screen(ChooserScreen(self.choices), self._chosen)
        self.refresh_panels()

    # -- connecting --------------------------------------------------------------------------
    def _chosen(self, index: int | None) -> None:
        if index is not None:
            self.attach(from_discovery(self.choices[index]))

    def attach(self, endpoint: Endpoint) -> None:
        """Watch `endpoint` (starting the feed worker unless feed=False)."""
        self.endpoint = endpoint
        self.header.target = f"waiting for an agent at {endpoint}"
        if self.feed_enabled:
            self._feed(endpoint)
        self.refresh_panels()

    @work(thread=True, exclusive=True, group="feed")
    def _feed(self, endpoint: Endpoint) -> None:
        worker = get_current_worker()
        run_feed(endpoint, self.post_message, lambda: worker.is_cancelled)

    # -- messages up ---------------------------------------------------------------------------
    def on_hello_received(self, message: HelloReceived) -> None:
        self.state.apply_hello(message.hello)
        self.state.gone = False
        self.feed_error = ""
        self._dirty = True

    def on_snapshot_received(self, message: SnapshotReceived) -> None:
        self.state.apply_snapshot(message.steps, message.seq)
        self._dirty = True

    def on_batches_received(self, message: BatchesReceived) -> None:
        now = self.clock()
        for batch in message.batches:
            self.state.apply_batch(batch, now)
        self.state.bad_frames = max(self.state.bad_frames, message.bad_frames)
        if message.last_error:
            self.state.last_error = message.last_error
        self._dirty = self._dirty or bool(message.batches)

    def on_feed_error(self, message: FeedError) -> None:
        self.feed_error = message.error
        if message.lost:
            self.state.gone = True

    # -- attributes down -----------------------------------------------------------------------
    def _tick(self) -> None:
        """The REFRESH_S timer: status always; panels when new data came and the CPU budget allows.

        Recomputing a full window costs O(steps): ~20k steps at a few kHz take tens of ms, so
        the panels then refresh less often than 4 Hz rather than take a core from training.
        """
        start = time.perf_counter()
        if not self._dirty or start < self._next_full:
            self._refresh_status()
            return
        self.refresh_panels()
        self._next_full = start + (time.perf_counter() - start) / MAX_CPU_SHARE

    def refresh_panels(self) -> None:
        """Recompute every panel's values from the state and push them into the widgets."""
        self._dirty = False
        state = self.state
        steps = state.window(WINDOW_S)
        stats = step_stats(steps)

        hello = state.hello
        self.header.hello = hello
        self.header.age_s = max(0.0, state.agent_time - hello.start_time) if hello and state.agent_time else 0.0

        self.step_panel.stats = stats
        self.step_panel.count = len(steps)
        self.step_panel.last_step = steps[-1].i if steps else None
        self.step_panel.series = [s.wall_ns / 1e6 for s in steps[-SPARK_POINTS:]]
        self.step_panel.span_s = round(min(WINDOW_S, state.agent_time - steps[0].t0), 1) if steps else None

        self.phase_panel.shares = breakdown(steps)
        self.phase_panel.ms = phase_ms(steps)
        self.phase_panel.device = device_ms(steps)
        self.phase_panel.step_ms = stats["mean_ms"]
        self.phase_panel.sample_every = hello.cuda_sample_every if hello else 0
        self.phase_panel.count = len(steps)
        self._refresh_status()

    def _refresh_status(self) -> None:
        state = self.state
        status = self.status_line
        status.connection = state.connection(self.clock()) if self.endpoint else "choose an agent"
        status.batches = state.batches
        status.gaps = state.gaps
        status.dropped = state.dropped
        status.bad_frames = state.bad_frames
        status.hook_errors = state.hook_errors
        status.error = self.feed_error or state.last_error

    # -- keys ----------------------------------------------------------------------------------
    def action_help(self) -> None:
        if isinstance(self.screen, HelpScreen):
            self.screen.dismiss(None)
        else:
            self.push_screen(HelpScreen())


def run_tui(endpoint: Endpoint | None, choices: list[dict[str, Any]] | None) -> int:
    """Run the TUI on `endpoint`, or on one of `choices` (discovery entries); the exit code."""
    app = TorchtopApp(endpoint, choices)
    app.run()
    return app.return_code or 0
