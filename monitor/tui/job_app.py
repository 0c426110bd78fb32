"""`torchtop attach` on a job: every rank in one view.

The Ranks tab shows each rank against the median rank (widgets/ranks_panel.py), the job's
verdict (the straggler, with its reason and cost) and its scaling. The existing tabs show the job
as a whole (its aggregate steps: the mean rank) or one rank: `j` the job, `[` `]` the previous or
next rank, `s` the slowest, or a click on a rank's line. Built on TorchtopApp: the same panels
read `self.state`, which is the aggregate's RunState or the focused rank's.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import Static, TabPane
from textual.worker import get_current_worker

from torchtop.contract.request_commands import Command
from torchtop.monitor.diagnosis.diagnose import diagnose
from torchtop.monitor.diagnosis.facts import Diagnosis
from torchtop.monitor.diagnosis.job_diagnosis import (
    WINDOW_S,
    diagnose_job,
    ended,
    rank_times,
    rank_view,
    window_end,
)
from torchtop.monitor.diagnosis.straggler import Straggler, scaling
from torchtop.monitor.diagnosis.window import Window, job_window
from torchtop.monitor.link.job_link import FOLLOW, JobLink, apply_events
from torchtop.monitor.link.job_targets import JobPlan, ranks_text, short_job_id
from torchtop.monitor.model import fmt
from torchtop.monitor.model.captures import capture_lines, fetch_from, progress_text
from torchtop.monitor.model.job_captures import JobCaptures, round_summary, start_step
from torchtop.monitor.model.job_state import JobState, Member
from torchtop.monitor.model.ranks_view import ranks_view
from torchtop.monitor.model.state import Link, RunState
from torchtop.monitor.tui import bindings
from torchtop.monitor.tui.app import TorchtopApp
from torchtop.monitor.tui.app_keys import scroll
from torchtop.monitor.tui.job_feed import JobEvents, JobFeedError, JobRequest, run_job_feed
from torchtop.monitor.tui.widgets import CapturesScreen, HelpScreen
from torchtop.monitor.tui.widgets.ranks_panel import RanksPanel, focus_text, head_lines

if TYPE_CHECKING:
    from torchtop.monitor.link.targets import Endpoint


STATUS_EVERY_RANKS = 64  # jobs of more ranks refresh their status line once a second
JOB_BINDINGS = [
    Binding(
        "0", "tab('ranks')", "Ranks", show=False, tooltip="the Ranks tab: every rank against the median rank"
    ),
    Binding("j", "show_job", "Job", tooltip="the other tabs show the job (the mean of its ranks)"),
    Binding("left_square_bracket", "rank(-1)", show=False, key_display="[", tooltip="... the previous rank"),
    Binding("right_square_bracket", "rank(1)", show=False, key_display="]", tooltip="... the next rank"),
    Binding(
        "s", "slowest", "Slowest", tooltip="... the slowest rank (the straggler); a click: the rank clicked"
    ),
]


class JobApp(TorchtopApp):
    """The dashboard over a job; `feed=False` starts no worker (tests post JobEvents)."""

    FIRST_TAB = "ranks"
    refresh_s = 0.5  # 2 Hz: a refresh redraws every rank's line (64 ranks at 200 steps/s: benchmarks.md)
    BINDINGS = [*TorchtopApp.BINDINGS, *JOB_BINDINGS]

    def __init__(
        self,
        plan: JobPlan | None = None,
        *,
        feed: bool = True,
        clock: Callable[[], float] = time.monotonic,
        log_path: Path | None = None,
        baseline_ms: float | None = None,
        leaving: bindings.Leaving | None = None,
    ) -> None:
        super().__init__(None, None, feed=feed, clock=clock, log_path=log_path, leaving=leaving)
        self.plan = plan or JobPlan([])
        self.job = JobState(self.plan.job_id)
        for line in self.plan.notes:
            self.job.note(line)
        self.baseline_ms = baseline_ms
        self.shown_key: str | None = None  # a member's key; None: the job's aggregate
        self.state = self.job.job
        self.straggler: Straggler | None = None
        self.job_diagnosis: Diagnosis | None = None
        self._job_window: Window | None = None  # this refresh's, chosen once (window.py)
        self._status_due = 0.0  # a large job's status line is next refreshed then (monotonic)
        self.ranks_panel = RanksPanel(id="ranks-panel")
        self.focus_bar = Static(id="focus-bar")
        self.job_requests: queue.SimpleQueue[JobRequest] = queue.SimpleQueue()
        self.job_captures = JobCaptures()
        self._telemetry_rank: int | None = None  # whose memory/GPU/host the job's tabs show

    # -- layout --------------------------------------------------------------------------------
    def compose_bar(self) -> ComposeResult:
        yield self.focus_bar

    def compose_first_tabs(self) -> ComposeResult:
        with TabPane("Ranks", id="ranks"), VerticalScroll(id="ranks-scroll"):
            yield self.ranks_panel

    def on_mount(self) -> None:
        super().on_mount()
        self.ranks_panel.border_title = "ranks"
        self.header.target = "waiting for the job's ranks"
        if self.feed_enabled and (self.plan.endpoints or self.plan.relays):
            self._job_feed(self.plan.endpoints)

    @work(thread=True, exclusive=True, group="job-feed")
    def _job_feed(self, endpoints: list[Endpoint]) -> None:
        worker = get_current_worker()
        link = JobLink(endpoints, relays=self.plan.relays)
        run_job_feed(link, self.post_message, lambda: worker.is_cancelled, self.job_requests)

    # -- messages up ---------------------------------------------------------------------------
    def on_job_events(self, message: JobEvents) -> None:
        apply_events(self.job, message.events, self.clock())
        seen = False
        for ev in message.events:
            if ev.kind == "reply":
                self._reply(ev.key, ev.cmd, ev.reply, ev.error)
            elif ev.kind == "batches":
                for got in ev.batches:
                    if got.batch.capture is not None:
                        self.job_captures.book(ev.key).see(got.batch.capture)
                        seen = True
        if seen:
            self._round_done()
            self._refresh_captures()
        self._dirty = True

    def on_job_feed_error(self, message: JobFeedError) -> None:
        self.feed_error = message.error

    def _reply(self, key: str, cmd: str, reply: Any, error: str) -> None:
        m = self.job.members.get(key)
        who = f"rank {m.rank}" if m is not None else key
        if reply is None:
            self.notify(f"{who}: {error}", title=f"{cmd}: no answer", severity="error", timeout=8)
        elif not reply.ok:
            self.notify(f"{who}: {reply.error}", title=f"{cmd} refused", severity="warning", timeout=8)
        elif cmd == Command.CAPTURE_STATUS:
            self.job_captures.book(key).merge(reply.captures)
        elif cmd.startswith("capture-"):
            self.job_captures.requested(key, reply.capture)
        self._refresh_captures()

    # -- captures across ranks -----------------------------------------------------------------
    def _capture(self, cmd: str) -> None:
        """The same steps on every running rank (the job shown), or on the rank shown."""
        m = self.shown_member()
        keys = [m.key] if m is not None else [x.key for x in self.job.live()]
        if not keys:
            self.notify("no rank is connected", title="capture", severity="warning")
            return
        args: dict[str, Any] = {"steps": self.capture_steps}
        if len(keys) > 1:
            args["at_step"] = start_step(self.job)
            self.job_captures.ask(cmd, args["at_step"], self.capture_steps, keys)
            self.notify(
                f"{len(keys)} ranks, steps #{args['at_step']}-#{args['at_step'] + self.capture_steps - 1}"
            )
        self.job_requests.put((cmd, args, keys))

    def action_profile(self) -> None:
        self._capture(Command.CAPTURE_PROFILE)

    def action_memory_snapshot(self) -> None:
        self._capture(Command.CAPTURE_MEMORY)

    def _round_done(self) -> None:
        r = self.job_captures.round
        if r is None or r.announced or not self.job_captures.finished():
            return
        r.announced = True
        lines = round_summary(self.job, self.job_captures)
        if lines:  # short: the toast stays a corner of an 80x24 screen; the Captures screen has it all
            self.notify(
                f"{len(r.keys)} ranks · c: their files",  # one line: the toast keeps off the tabs
                title="captures done on every rank",
                timeout=20,
            )

    def _refresh_captures(self) -> None:
        caps = self.job_captures
        self.capture_line.capture = caps.current()
        self.capture_line.count = caps.count()
        screen = self.screen
        if not isinstance(screen, CapturesScreen):
            return
        entries = []
        for m in self.job.ranked():
            book = caps.books.get(m.key)
            for c in book.listing() if book is not None else []:
                lines = capture_lines(
                    c, fetch_from(m.key, m.state.hello.host if m.state.hello else "", c.host)
                )
                entries.append([f"rank {m.rank} · {lines[0]}", *lines[1:]])
        screen.entries = entries
        summary = round_summary(self.job, caps) if caps.finished() else []
        active = caps.current()
        screen.note = "\n".join(summary) if summary else (progress_text(active) if active is not None else "")

    def on_captures_screen_refresh_wanted(self, _message: CapturesScreen.RefreshWanted) -> None:
        self.job_requests.put((Command.CAPTURE_STATUS, {}, [m.key for m in self.job.live()]))

    def on_ranks_panel_chosen(self, message: RanksPanel.Chosen) -> None:
        self.show_member(message.key)
        self.action_tab("overview")

    def action_help(self) -> None:
        if isinstance(self.screen, HelpScreen):
            self.screen.dismiss(None)
        else:
            rows = bindings.help_rows(self.check_action) + [
                (b.key_display or b.key, b.tooltip) for b in JOB_BINDINGS
            ]
            rows.append(("p m", "in the job view: the same N steps on every rank (or on the rank shown)"))
            self.push_screen(HelpScreen(self.error_rows() + rows))  # the error first: it is why ? was pressed

    def action_scroll(self, key: str) -> None:
        if self._tab() != "ranks" or len(self.screen_stack) > 1:
            super().action_scroll(key)
            return
        target = self.query_one("#ranks-scroll", VerticalScroll)
        scroll(target, key)

    # -- focus ---------------------------------------------------------------------------------
    def shown_member(self) -> Member | None:
        return self.job.members.get(self.shown_key) if self.shown_key is not None else None

    def show_member(self, key: str | None) -> None:
        """Show the job's aggregate (None) or one member in the panels."""
        self.shown_key = key if key is None or key in self.job.members else None
        m = self.shown_member()
        self.state = m.state if m is not None else self.job.job
        if self.plan.relays:  # a relayed rank's full stream comes only while it is shown
            self.job_requests.put((FOLLOW, {}, [m.key] if m is not None and m.via else []))
        self.diagnosis = None  # hysteresis is per thing shown
        self.refresh_panels()

    def action_show_job(self) -> None:
        self.show_member(None)

    def action_rank(self, step: int) -> None:
        ranked = self.job.ranked()
        if not ranked:
            return
        keys = [m.key for m in ranked]
        if self.shown_key not in keys:
            self.show_member(keys[0] if step > 0 else keys[-1])
        else:
            self.show_member(keys[(keys.index(self.shown_key) + step) % len(keys)])

    def action_slowest(self) -> None:
        rank = self.straggler.rank if self.straggler is not None else None
        if rank is None:
            times = rank_times(self.job)
            rank = max(times, key=lambda r: times[r].busy_ms) if times else None
        m = next((m for m in self.job.ranked() if m.rank == rank), None)
        if m is not None:
            self.show_member(m.key)

    # -- attributes down -----------------------------------------------------------------------
    def choose_window(self, state: RunState) -> Window:
        """The job's pooled window where the job is shown (its verdict's), else the rank's own."""
        if self.shown_key is None and self._job_window is not None:
            return self._job_window
        return super().choose_window(state)

    def judge(self, state: RunState, window: Window | None = None) -> Diagnosis:
        window = window or self.choose_window(state)
        if self.shown_key is None:
            return self.job_diagnosis or diagnose(state, self.diagnosis, window=window)
        own = diagnose(state, self.diagnosis, window=window)
        m = self.shown_member()
        if self.job_diagnosis is None or m is None or m.hello is None or len(self.job.live()) < 2:
            return own
        # the rank's verdict agrees with the job's: a rank held by a straggler waits for it
        return rank_view(self.job_diagnosis, own, m.rank, self.straggler, rank_times(self.job))

    def refresh_panels(self) -> None:
        job = self.job
        self._aggregate_telemetry()
        self._job_window = job_window(job, WINDOW_S)  # the job's verdict and its panels: one window
        judged, found = diagnose_job(job, self.job_diagnosis, chosen=self._job_window)
        if not ended(judged) and judged is not self.job_diagnosis:  # an ended job keeps its straggler too
            self.straggler = found
        self.job_diagnosis = judged
        super().refresh_panels()
        m = self.shown_member()
        if m is None:
            self.header.hello = None
            ranked = job.ranked()
            device = job.job.hello.device if job.job.hello else "?"
            ranks = f"{len(ranked)} {fmt.plural(len(ranked), 'rank')}"
            self.header.target = f"job {short_job_id(job.job_id) or '?'} · {ranks} · {device}"
        self.focus_bar.update(focus_text(job, m, self.size.width))
        top = self._telemetry_rank if m is None else None
        which = f" · rank {top} (the most memory)" if top is not None else ""
        self.query_one("#memory-panel").border_title = "CUDA memory" + which
        self.query_one("#host-panel").border_title = "host · psutil" + which
        now = self.clock()
        self.ranks_panel.show(ranks_view(job, WINDOW_S, window_end(job), now), self._head())
        self.ranks_panel.border_title = f"ranks · last {WINDOW_S:.0f} s"

    def _aggregate_telemetry(self) -> None:
        """The aggregate's memory/GPU/host panels show the rank using the most memory."""
        top = self.job.share_telemetry()
        if top is not None:
            self._telemetry_rank = top

    def _head(self) -> list[Text]:
        times = rank_times(self.job)
        straggler = self.straggler.rank if self.straggler is not None else None
        return head_lines(
            self.job, times, scaling(times, self.baseline_ms), self.job_diagnosis, self.clock(), straggler
        )

    def _refresh_status(self) -> None:
        job = self.job
        at = time.monotonic()
        if len(job.members) > STATUS_EVERY_RANKS and at < self._status_due:
            return  # a large job's status line once a second: 1,024 ranks' links are ~7 ms a pass
        self._status_due = at + 1.0
        super()._refresh_status()
        status, now = self.status_line, self.clock()
        ranked = job.ranked()
        links = [m.state.link(now) for m in ranked]
        up = links.count(Link.CONNECTED)
        gone = [m.rank for m, link in zip(ranked, links) if link == Link.GONE]
        waiting = [m for m in job.members.values() if m.hello is None]
        # green when every rank answers, red when none does, yellow between
        status.link = (
            Link.CONNECTED
            if ranked and up == len(ranked)
            else Link.GONE
            if gone and len(gone) == len(ranked)
            else Link.WAITING
        )
        troubles = [t for t in (ep.link_trouble() for ep in self.plan.endpoints + self.plan.relays) if t]
        status.tunnel_down = bool(troubles)
        of = f"{len(ranked)} {fmt.plural(len(ranked), 'rank')}"
        text = f"connected · {up} of {of}" if ranked else "waiting for the ranks"
        if gone:
            text += f" · gone: rank{'s' if len(gone) > 1 else ''} {ranks_text(gone)}"
        if len(links) - up - len(gone):
            text += f" · stale: {len(links) - up - len(gone)}"
        if waiting:
            text += f" · not answering: {len(waiting)}"
        if troubles:
            text = f"{troubles[0]}{f' (and {len(troubles) - 1} more)' if len(troubles) > 1 else ''} · {text}"
        status.connection = text if up else text.replace("connected · ", "")
        members = list(job.members.values())
        status.batches = sum(m.state.batches for m in members)
        status.gaps = sum(m.state.gaps for m in members)
        status.dropped = sum(m.state.dropped for m in members)
        status.bad_frames = sum(m.state.bad_frames for m in members)
        status.hook_errors = sum(m.state.hook_errors for m in members)
        errors = [m.error for m in members if m.error]
        status.error = self.feed_error or (errors[0] if errors else "")
        self.capture_line.capture = self.job_captures.current()
        self.capture_line.count = self.job_captures.count()
