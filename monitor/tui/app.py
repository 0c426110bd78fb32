"""`torchtop attach`: the live TUI on one agent.

Messages up, attributes down: a thread worker (tui/feed.py) owns the AgentClient and posts
messages; the app applies them to a pure RunState, and a ~4 Hz timer pushes plain values from
that state into the widgets' reactive attributes (never per batch: a 10 kHz loop must not
make the terminal the bottleneck). Requests to the agent (captures) go to the worker through a
queue; its answers come back as messages. Never imports torch.

Tabs: Overview (step time, verdict, phases, marks), Memory, GPU · Host, and under `torchtop run`
the job's Log. Panels of a hidden tab get only the latest samples (cheap); the memory plot's
series is computed while it is shown. Below 32 rows the screen gets the class -short (app.tcss
packs the panels tighter); the tabs scroll from the keyboard wherever the focus is.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.scrollbar import ScrollBar, ScrollBarRender
from textual.widgets import TabbedContent, TabPane
from textual.worker import get_current_worker

from torchtop.contract.discovery import AgentInfo
from torchtop.contract.wire import CAPTURE_DEFAULT_STEPS
from torchtop.monitor.diagnosis.diagnose import diagnose
from torchtop.monitor.diagnosis.facts import THRESHOLDS as T
from torchtop.monitor.diagnosis.facts import Diagnosis
from torchtop.monitor.diagnosis.warmup import latency_ms
from torchtop.monitor.diagnosis.window import Window, choose
from torchtop.monitor.link.record import MonitorRecorder
from torchtop.monitor.link.targets import Endpoint, from_discovery
from torchtop.monitor.model.captures import CaptureBook
from torchtop.monitor.model.panel_data import (
    mark_rows,
    step_counts,
    train_number,
)
from torchtop.monitor.model.state import (
    Link,
    RunState,
    device_ms,
    step_stats,
    timed,
)
from torchtop.monitor.tui import bindings, telemetry_panels
from torchtop.monitor.tui.app_keys import AppKeys
from torchtop.monitor.tui.capture_flow import CaptureApp
from torchtop.monitor.tui.feed import (
    BatchesReceived,
    FeedError,
    HelloReceived,
    SnapshotReceived,
    run_feed,
)
from torchtop.monitor.tui.widgets import (
    CaptureLine,
    ChooserScreen,
    GpuPanel,
    HostFigures,
    KeyBar,
    LogTail,
    MarksPanel,
    MemoryFigures,
    MemoryPlot,
    PhasePanel,
    RunHeader,
    StatusLine,
    StepPanel,
    VerdictPanel,
    WhyPanel,
    WorkerTable,
)

WINDOW_S = T.window_s  # seconds of agent time the panels and the verdict judge (window.py)
REFRESH_S = 0.25  # widget refresh period (4 Hz)
SPARK_POINTS = 2000  # most step times handed to the sparkline (it buckets them to its width)
MAX_CPU_SHARE = 0.05  # of one core, for recomputing the panels (see TorchtopApp._tick)


class WholeCellScrollBar(ScrollBarRender):
    """A scrollbar whose thumb is whole coloured cells: Textual's eighth-block glyphs at the
    thumb's ends read as stray blocks beside the panels (tmux capture, few-colour terminals)."""

    VERTICAL_BARS = [" "] * 8
    HORIZONTAL_BARS = [" "] * 8


ScrollBar.renderer = WholeCellScrollBar  # the monitor's process draws only this app


class TorchtopApp(AppKeys, CaptureApp):
    """The dashboard. `feed=False` starts no worker, so tests can post messages themselves;
    `clock` replaces time.monotonic (staleness), so snapshot tests render the same every time."""

    CSS_PATH = "app.tcss"
    TITLE = "torchtop"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = [*bindings.BINDINGS]  # typed as Textual's list[BindingType] (a list is invariant)
    VERTICAL_BREAKPOINTS = [(0, "-short"), (32, "-tall")]

    def __init__(
        self,
        endpoint: Endpoint | None = None,
        choices: list[AgentInfo] | None = None,
        *,
        feed: bool = True,
        clock: Callable[[], float] = time.monotonic,
        log_path: Path | None = None,
        leaving: bindings.Leaving | None = None,
        record: Path | None = None,
    ) -> None:
        super().__init__()
        self.leaving = leaving or bindings.Leaving()
        self.record = record  # attach --record: the feed keeps what it receives here
        self.log_tail = LogTail(log_path, id="log-tail") if log_path is not None else None
        self.endpoint = endpoint
        self.choices = choices or []
        self.feed_enabled = feed
        self.clock = clock
        self.state = RunState()
        self.feed_error = ""
        self._dirty = True  # new data since the panels were last recomputed
        self._next_full = 0.0  # perf_counter time before which _tick skips the recompute
        self._plot_due = 0.0  # perf_counter time from which the memory plot may be redrawn
        self.header = RunHeader(id="run-header")
        self.step_panel = StepPanel(WINDOW_S, id="step-panel")
        self.phase_panel = PhasePanel(id="phase-panel")
        self.why_panel = WhyPanel(id="why-panel")
        self.status_line = StatusLine(id="status-line")
        self.verdict_panel = VerdictPanel(id="verdict-panel")
        self.marks_panel = MarksPanel(id="marks-panel")
        self.memory_figures = MemoryFigures(id="memory-figures")
        self.memory_plot = MemoryPlot(id="memory-plot")
        self.gpu_panel = GpuPanel(id="gpu-panel")
        self.host_figures = HostFigures(id="host-figures")
        self.worker_table = WorkerTable(id="worker-table")
        self.capture_line = CaptureLine(id="capture-line")
        self.diagnosis: Diagnosis | None = None  # the previous verdict: diagnose()'s hysteresis
        self.captures = CaptureBook()
        self.capture_steps = CAPTURE_DEFAULT_STEPS
        self.requests: queue.SimpleQueue[tuple[str, dict[str, Any]]] = (
            queue.SimpleQueue()
        )  # to the feed worker

    FIRST_TAB = "overview"
    refresh_s = REFRESH_S  # the panels' refresh period

    def compose_bar(self) -> ComposeResult:
        """A line under the header (the job view's focus bar); none for one agent."""
        yield from ()

    def compose_first_tabs(self) -> ComposeResult:
        """Tabs before Overview (the job view's Ranks tab); none for one agent."""
        yield from ()

    def compose(self) -> ComposeResult:
        yield self.header
        yield from self.compose_bar()
        with TabbedContent(initial=self.FIRST_TAB, id="tabs"):
            yield from self.compose_first_tabs()
            with TabPane("Overview", id="overview"), VerticalScroll(id="overview-scroll"):
                yield self.step_panel
                yield self.verdict_panel
                yield self.phase_panel
                yield self.why_panel
                yield self.marks_panel
            with (
                TabPane("Memory", id="memory"),
                VerticalScroll(id="memory-scroll"),
                Vertical(id="memory-panel"),
            ):
                yield self.memory_figures
                yield self.memory_plot
            with TabPane("GPU · Host", id="gpu-host"), VerticalScroll(id="gpu-host-scroll"):
                yield self.gpu_panel
                with Vertical(id="host-panel"):
                    yield self.host_figures
                    yield self.worker_table
            if self.log_tail is not None:
                with TabPane("Log", id="log"):
                    yield self.log_tail
        yield self.capture_line
        yield self.status_line
        yield KeyBar()  # one line: the keys that do not fit are dropped, never cut

    def on_mount(self) -> None:
        self.query_one("#memory-panel").border_title = "CUDA memory"
        self.query_one("#host-panel").border_title = "host · psutil"
        self.set_interval(self.refresh_s, self._tick)
        if self.log_tail is not None:
            self.log_tail.border_title = f"output · {self.log_tail.path}"
            self.set_interval(0.5, self.log_tail.poll)
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
        recorder = MonitorRecorder(self.record) if self.record is not None else None
        run_feed(
            endpoint,
            self.post_message,
            lambda: worker.is_cancelled,
            requests=self.requests,
            recorder=recorder,
        )

    # -- messages up ---------------------------------------------------------------------------
    def on_hello_received(self, message: HelloReceived) -> None:
        runs = self.state.new_runs
        self.state.apply_hello(message.hello)
        self.state.gone = False
        self.feed_error = ""
        self._dirty = True
        if self.state.new_runs != runs:
            self._new_run()

    def _new_run(self) -> None:
        """Another run on the same port: its verdict starts afresh and its capture ids restart."""
        self.diagnosis = None
        self.captures.reset()
        self._refresh_captures()

    def on_snapshot_received(self, message: SnapshotReceived) -> None:
        self.state.apply_snapshot(message.steps, message.seq, message.tally, message.wall_offset)
        if message.memory:
            self.state.apply_memory(message.memory)
        self._dirty = True

    def on_batches_received(self, message: BatchesReceived) -> None:
        now = self.clock()
        for got in message.batches:
            batch = got.batch
            runs = self.state.new_runs
            self.state.apply_batch(batch, got.steps, now, got.log_errors)
            if self.state.new_runs != runs:
                self._new_run()
            self._capture_seen(batch)
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
        cpu = time.thread_time()
        self.refresh_panels()
        # its CPU time: on a busy machine the wall time would delay the panels for no CPU saved
        self._next_full = start + (time.thread_time() - cpu) / MAX_CPU_SHARE

    def refresh_panels(self) -> None:
        """Recompute every panel's values from the state and push them into the widgets."""
        self._dirty = False
        state = self.state
        window = self.choose_window(state)  # one window: every panel and the verdict read it
        summary, steps, stats = window.summary, window.steps, window.summary.stats

        hello = state.hello
        self.header.hello = hello
        self.header.age_s = (
            max(0.0, state.agent_time - hello.start_time) if hello and state.agent_time else 0.0
        )

        # an eval or serving loop (no training step judged): its forward passes' latency instead
        inference = window.judged is not None and window.judged.kind == "eval"
        shown = summary.evals if inference else summary.in_full
        if inference:
            stats = dict(step_stats(shown), p99_ms=latency_ms(shown)[1])
        self.step_panel.inference = inference
        self.step_panel.stats = stats
        self.step_panel.count = len(shown) if inference else summary.steps
        self.step_panel.in_full = len(shown)
        self.step_panel.last_step = (
            train_number(shown[-1], summary.evals, state.tally.evals_total())
            if shown and not inference
            else None
        )
        self.step_panel.series = [s.wall_ns / 1e6 for s in shown[-SPARK_POINTS:]]
        self.step_panel.window_s = window.seconds
        start = shown[0].t0 if inference and shown else summary.start
        self.step_panel.span_s = round(min(window.seconds, state.agent_time - start), 1) if shown else None

        self.phase_panel.shares = window.breakdown()
        self.phase_panel.ms = window.phase_ms()
        self.phase_panel.device = device_ms(steps)
        self.phase_panel.step_ms = stats["mean_ms"]
        self.phase_panel.event_every = hello.cuda_event_every if hello else 0
        self.phase_panel.timed = len(timed(steps))
        self.phase_panel.count = len(steps)

        self.why_panel.shares = self.phase_panel.shares
        self.why_panel.step_ms = stats["mean_ms"]
        self.why_panel.why = window.why

        skipped, evals = step_counts(summary.in_full, summary.evals)
        self.step_panel.evals = evals
        self.step_panel.eval_latency = latency_ms(summary.evals) if evals and not inference else None
        self.step_panel.skipped = skipped
        self.diagnosis = self.judge(state, window)
        self.verdict_panel.diagnosis = self.diagnosis
        self.marks_panel.rows = mark_rows(state.steps)
        telemetry_panels.fill(self, window.seconds)
        self._refresh_status()

    def choose_window(self, state: RunState) -> Window:
        """The refresh's one window over `state` (the job view pools its ranks' own steps)."""
        return choose(state, WINDOW_S)

    def judge(self, state: RunState, window: Window | None = None) -> Diagnosis:
        """The verdict panel's diagnosis of `state` over `window` (this refresh's; chosen here when
        not given); the previous one gives hysteresis."""
        return diagnose(state, self.diagnosis, window=window or self.choose_window(state))

    def _refresh_status(self) -> None:
        state = self.state
        status = self.status_line
        now = self.clock()
        status.link = state.link(now) if self.endpoint else Link.UNCHOSEN
        status.connection = state.connection(now) if self.endpoint else str(Link.UNCHOSEN)
        trouble = self.endpoint.link_trouble() if self.endpoint else ""
        status.tunnel_down = bool(trouble)
        if trouble:
            status.connection = f"{trouble} · {status.connection}"
        status.batches = state.batches
        status.gaps = state.gaps
        status.dropped = state.dropped
        status.bad_frames = state.bad_frames
        status.hook_errors = state.hook_errors
        status.error = self.feed_error or state.last_error
        self.capture_line.capture = self.captures.current
        self.capture_line.steps = self.capture_steps
        self.capture_line.count = len(self.captures.by_id)

    # -- keys ----------------------------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """q and Ctrl-C: only the pair of this way of opening; tab 4 only with a Log tab; a scroll
        key that a subclass binds itself (the replay's Home and End seek) is the subclass's."""
        if action in ("leave", "interrupt"):
            return parameters[:1] == (self.leaving.mode,)
        if action == "tab":
            return parameters[:1] != ("log",) or self.log_tail is not None
        if action == "scroll" and type(self) is not TorchtopApp:  # a subclass's own key wins
            keys = [b.key for b in type(self).BINDINGS if isinstance(b, Binding)]  # ours are all Binding
            return all(str(parameters[0]) not in k.split(",") for k in keys)
        return True

    def on_tabbed_content_tab_activated(self, _event: TabbedContent.TabActivated) -> None:
        self._plot_due = 0.0
        self.refresh_panels()  # a tab shown: its panels (the memory plot) now, not at the next tick


def run_tui(
    endpoint: Endpoint | None,
    choices: list[AgentInfo] | None,
    log_path: Path | None = None,
    mode: bindings.LeaveMode = "attach",
    record: Path | None = None,
) -> int:
    """Run the TUI on `endpoint`, or on one of `choices` (discovery entries); the exit code.
    With `log_path`, a Log tab follows the job's output; with `record`, what it receives is
    recorded there. `mode` says what q and Ctrl-C do (bindings.QUIT_WORDS); `torchtop run` builds
    its app itself, with the job's Ctrl-C callback."""
    app = TorchtopApp(endpoint, choices, log_path=log_path, leaving=bindings.Leaving(mode), record=record)
    app.run()
    return app.return_code or 0
