"""Step time panel: now / median / p90 and steps/s over the recent window, plus a sparkline.

The app sets `stats` (a `state.step_stats` dict), `count`, `last_step` and `series`; the panel
only formats them, so what it shows is exactly what `torchtop report` computes.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.reactive import reactive
from textual.widgets import Sparkline, Static

from torchtop.monitor.model import fmt

EMPTY_STATS = {"now_ms": 0.0, "median_ms": 0.0, "p90_ms": 0.0, "mean_ms": 0.0, "steps_per_s": 0.0}


BREAK = Text("\n")  # a group of its own: the next group starts a line


def eval_groups(evals: int, latency: tuple[float, float] | None) -> list[Text]:
    """A train loop's eval passes in the window, on a line of their own: how many and their
    latency (p50/p99), so they are never read as training steps."""
    groups = [
        Text.assemble(
            ("eval ", "dim"), (fmt.count(evals), "bold"), (f" {fmt.plural(evals, 'pass', 'passes')}", "dim")
        )
    ]
    if latency is not None:
        groups += [
            Text.assemble(("p50 ", "dim"), (fmt.ms(latency[0]), "bold"), (" ms", "dim")),
            Text.assemble(("p99 ", "dim"), (fmt.ms(latency[1]), "bold"), (" ms", "dim")),
        ]
    return groups


def step_groups(
    stats: dict[str, float],
    count: int,
    last_step: int | None,
    evals: int = 0,
    skipped: int = 0,
    eval_latency: tuple[float, float] | None = None,
) -> list[Text]:
    """The figures, one group each (a label never parts from its number); labels dim, numbers
    bold, so the eye finds the numbers. GradScaler-skipped optimizer steps follow when there are
    any, then the window's eval passes on their own line. `last_step`: the newest training step's
    number (eval passes not counted)."""
    if not count:
        groups = [Text("no training steps in the window yet", style="dim")]
        if evals:
            groups += [BREAK, *eval_groups(evals, eval_latency)]
        return groups
    groups = []
    for label, value, unit in (
        ("now", fmt.ms(stats["now_ms"]), " ms"),
        ("median", fmt.ms(stats["median_ms"]), " ms"),
        ("p90", fmt.ms(stats["p90_ms"]), " ms"),
        ("", fmt.rate(stats["steps_per_s"]), " steps/s"),
        ("", fmt.count(count), " steps in window"),
    ):
        groups.append(Text.assemble((f"{label} " if label else "", "dim"), (value, "bold"), (unit, "dim")))
    if last_step is not None:
        groups.append(Text.assemble(("latest ", "dim"), (f"#{fmt.count(last_step)}", "bold")))
    if skipped:
        groups.append(
            Text.assemble(("skipped ", "dim"), (fmt.count(skipped), "bold yellow"), (" (GradScaler)", "dim"))
        )
    if evals:
        groups += [BREAK, *eval_groups(evals, eval_latency)]
    return groups


def latency_groups(stats: dict[str, float], count: int) -> list[Text]:
    """An eval or serving loop's figures: its forward passes' latency (p50/p90/p99) and rate."""
    if not count:
        return [Text("no forward passes in the window yet", style="dim")]
    groups = []
    for label, value, unit in (
        ("now", fmt.ms(stats["now_ms"]), " ms"),
        ("p50", fmt.ms(stats["median_ms"]), " ms"),
        ("p90", fmt.ms(stats["p90_ms"]), " ms"),
        ("p99", fmt.ms(stats.get("p99_ms", 0.0)), " ms"),
        ("", fmt.rate(stats["steps_per_s"]), " passes/s"),
        ("", fmt.count(count), f" forward {fmt.plural(count, 'pass', 'passes')} in window"),
    ):
        groups.append(Text.assemble((f"{label} " if label else "", "dim"), (value, "bold"), (unit, "dim")))
    return groups


def step_line(
    stats: dict[str, float],
    count: int,
    last_step: int | None,
    evals: int = 0,
    skipped: int = 0,
    width: int = 0,
    inference: bool = False,
    eval_latency: tuple[float, float] | None = None,
) -> Text:
    """The groups three spaces apart; with a `width`, a group that would cross it starts a line.
    `inference`: the figures are forward passes' latency (no training step in the window)."""
    text = Text()
    line = 0
    groups = (
        latency_groups(stats, count)
        if inference
        else step_groups(stats, count, last_step, evals, skipped, eval_latency)
    )
    after_break = False
    for k, group in enumerate(groups):
        if group is BREAK:
            text.append("\n")
            line, after_break = 0, True
            continue
        if after_break:
            after_break = False
        elif k and width and line + 3 + group.cell_len > width:
            text.append("\n")
            line = 0
        elif k:
            text.append("   ")
            line += 3
        text.append_text(group)
        line += group.cell_len
    return text


def step_title(
    window_s: float, span_s: float | None, count: int, in_full: int, inference: bool = False
) -> str:
    """The panel's title: the span it covers (shorter than the window when the run is young) and,
    when not every step of it was kept whole, how many of them were (the phases are theirs)."""
    shown = window_s if span_s is None or span_s >= window_s - 0.05 else span_s
    title = f"{'forward latency' if inference else 'step time'} · last {shown:.3g} s"
    if count > in_full:
        title += f" · {fmt.count(count)} {fmt.plural(count, 'step')} ({fmt.count(in_full)} in full)"
    return title


class StepPanel(Vertical):
    """Step times over the last `window_s` seconds of agent time."""

    stats: reactive[dict[str, float]] = reactive(lambda: dict(EMPTY_STATS))
    count: reactive[int] = reactive(0)
    last_step: reactive[int | None] = reactive(None)
    series: reactive[list[float]] = reactive(list)
    span_s: reactive[float | None] = reactive(None)  # the agent time the window covers
    in_full: reactive[int] = reactive(0)  # of `count`, the steps kept whole (fewer: thinned)
    evals: reactive[int] = reactive(0)  # eval passes in the window
    eval_latency: reactive[tuple[float, float] | None] = reactive(None)  # their (p50, p99) ms
    skipped: reactive[int] = reactive(0)  # optimizer steps GradScaler skipped in the window
    inference: reactive[bool] = reactive(False)  # an eval loop's: forward passes' latency shown

    def __init__(self, window_s: float = 10.0, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(**kwargs)
        self.window_s = window_s
        self.border_title = f"step time · last {window_s:.3g} s"

    def watch_span_s(self) -> None:
        self._sync_title()

    def watch_in_full(self) -> None:
        self._sync_title()

    def _sync_title(self) -> None:
        self.border_title = step_title(self.window_s, self.span_s, self.count, self.in_full, self.inference)

    def compose(self) -> ComposeResult:
        yield Static(self._line(), id="step-numbers")
        yield Sparkline([], id="step-spark")

    def _sync_numbers(self) -> None:
        # mounted is not composed: on a loaded machine the app's first tick can come between the two
        for numbers in self.query("#step-numbers").results(Static):
            numbers.update(self._line(self.content_size.width))

    def on_resize(self) -> None:
        self._sync_numbers()  # the figures wrap between groups at the new width

    def watch_stats(self) -> None:
        self._sync_numbers()

    def watch_count(self) -> None:
        self._sync_numbers()
        self._sync_title()

    def watch_last_step(self) -> None:
        self._sync_numbers()

    def watch_evals(self) -> None:
        self._sync_numbers()

    def watch_eval_latency(self) -> None:
        self._sync_numbers()

    def watch_skipped(self) -> None:
        self._sync_numbers()

    def watch_inference(self) -> None:
        self._sync_numbers()
        self._sync_title()

    def watch_series(self, series: list[float]) -> None:
        # The sparkline has no axis: its range goes in the border, so bar heights mean something.
        self.border_subtitle = f"▁ {fmt.ms(min(series))} ms … █ {fmt.ms(max(series))} ms" if series else ""
        for spark in self.query("#step-spark").results(Sparkline):  # none yet before compose
            spark.data = series

    def numbers_text(self) -> str:
        """The figures line as plain text (what tests and screen readers see)."""
        return self._line().plain

    def _line(self, width: int = 0) -> Text:
        """The figures from the panel's attributes (wrapped at `width`, where given)."""
        return step_line(
            self.stats,
            self.count,
            self.last_step,
            self.evals,
            self.skipped,
            width,
            self.inference,
            self.eval_latency,
        )
