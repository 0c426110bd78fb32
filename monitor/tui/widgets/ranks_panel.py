"""The Ranks panel of the job view: every rank against the median rank, the slowest highlighted.

The app sets `view` (model/ranks_view.py), `summary` and `lines` (the straggler verdict, notes)
at its refresh rate; the panel only lays them out as text: a median row, the slowest ranks first
when there are many, then every rank grouped by node, each with its strip over time. A click on a
rank's line posts `Chosen(key)`: the app shows that rank in the other tabs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from rich.console import RenderableType
from rich.text import Text
from textual import events
from textual.message import Message
from textual.strip import Strip
from textual.visual import Visual, visualize
from textual.widget import Widget

from torchtop.monitor.diagnosis.facts import Diagnosis
from torchtop.monitor.diagnosis.persistence import persistence
from torchtop.monitor.diagnosis.straggler import Scaling
from torchtop.monitor.link.job_targets import ranks_text
from torchtop.monitor.model import fmt
from torchtop.monitor.model.job_state import JobState, Member
from torchtop.monitor.model.rank_stats import RankTimes
from torchtop.monitor.model.ranks_view import COLUMNS, MANY, TOP_K, RankRow, RanksView, deviation
from torchtop.monitor.model.relayed import coverage, coverage_line
from torchtop.monitor.tui.widgets.verdict_panel import SEVERITY_STYLES

MANY_FOR_COVERAGE = 8  # ranks beyond which the coverage line is always shown

WIDTHS = {"step": 7, "data": 7, "fwd+bwd": 8, "optim": 7, "comm": 7, "own": 7}
STATUS_STYLE = {"connected": "", "agent gone": "red", "refused": "red"}


COMPACT_BELOW = 110  # panel widths under this get compact rows: no memory or GPU column
COMPACT_STRIP = 12  # the strip's newest cells in a compact row


def _cells(
    row: RankRow | None, med: dict[str, float], label: str, node: str, slowest: bool, compact: bool = False
) -> Text:
    text = Text(no_wrap=True, overflow="crop")
    style = "bold reverse red" if slowest else ""
    text.append(f"{label:>6} ", style=style or "bold")
    if not compact:
        text.append(f"{node[:12]:<12} ", style="dim")
    elif node:
        text.append(f"{node[:8]:<8} ", style="dim")
    for c in COLUMNS:
        value = row.figures[c] if row is not None else med.get(c, 0.0)
        cell = fmt.ms(value).rjust(WIDTHS[c])
        hot = deviation(value, med.get(c, 0.0)) if row is not None and c != "step" else ""
        text.append(cell + " ", style="bold red" if hot == "hot" else "yellow" if hot == "warm" else "")
    if row is None:
        text.append(" " * (0 if compact else 18), style="dim")
        return text
    if not compact:
        text.append(f"{fmt.size(row.mem_peak) if row.mem_peak else '—':>10} ", style="")
        text.append(f"{row.gpu_util:>4.0f}% " if row.gpu_util is not None else "   — ", style="")
    strip = row.strip[-COMPACT_STRIP:] if compact else row.strip
    text.append(strip, style="red" if any(b in strip for b in "▆▇█") else "cyan")
    if row.status != "connected":
        text.append(f"  {row.status}", style=STATUS_STYLE.get(row.status, "yellow"))
    return text


def header_line(bucket_s: int, compact: bool = False, nodes: bool = False) -> Text:
    text = Text(no_wrap=True, overflow="crop", style="dim")
    text.append(f"{'rank':>6} " + (f"{'node':<12} " if not compact else f"{'node':<8} " if nodes else ""))
    for c in COLUMNS:
        text.append(c.rjust(WIDTHS[c]) + " ")
    text.append(f"trend ({bucket_s}s)" if compact else f"{'mem peak':>10}  GPU  own vs median ({bucket_s}s)")
    return text


def focus_text(job: JobState, focus: Member | None, width: int = 0) -> Text:
    """Who the tabs show, of which ranks, and the keys that change it; within `width` (0: any)
    the keys go first, then the ranks' list (the footer and the help name the keys)."""
    ranked = job.ranked()
    nodes = sorted({m.node for m in ranked})
    if focus is None:
        who = "the job (mean of its ranks)"
    else:
        pid = focus.hello.pid if focus.hello else "?"
        who = f"rank {focus.rank} (pid {pid} on {focus.node})"
    count = f"  of {len(ranked)} {fmt.plural(len(ranked), 'rank')}"
    which = f" ({ranks_text([m.rank for m in ranked])})"
    where = f" on {len(nodes)} {fmt.plural(len(nodes), 'node')}"
    keys = "   j job · [ ] rank · s slowest · click a rank"
    parts = [count + which + where, keys]
    for tail in (parts, parts[:1], [count + where], [count], []):
        if not width or len(" showing " + who + "".join(tail)) <= width:
            break
    text = Text(no_wrap=True, overflow="ellipsis")
    text.append(" showing ", style="dim")
    text.append(who, style="bold reverse cyan")
    text.append("".join(tail), style="dim")
    return text


def head_lines(
    job: JobState,
    times: dict[int, RankTimes],
    scale: Scaling | None,
    d: Diagnosis | None,
    now: float | None = None,
    straggler: int | None = None,
) -> list[Text]:
    """The lines above the table: the job's step and scaling, its verdict, notes (a node that
    failed, an agent of another job, versions that differ)."""
    head: list[Text] = []
    line = Text(no_wrap=True, overflow="ellipsis")
    if scale is not None:
        line.append("job step ", style="dim")
        line.append(f"{fmt.ms(scale.step_ms)} ms", style="bold")
        line.append("   scaling: compute ", style="dim")
        line.append(fmt.pct(scale.efficiency), style="bold")
        j = scale.to_json()
        for label, key in (
            ("comm", "lost_to_communication"),
            ("waiting", "lost_to_waiting"),
            ("other", "lost_to_other"),
        ):
            line.append(f"  {label} ", style="dim")
            line.append(fmt.pct(float(j[key])), style="bold")  # type: ignore[arg-type]
        if scale.vs_baseline is not None:
            line.append("   vs 1 rank ", style="dim")
            line.append(f"{scale.vs_baseline:.2f}", style="bold")
    else:
        line.append("waiting for steps from the ranks", style="dim")
    head.append(line)
    if d is not None and d.verdict.kind in ("straggler", "work-imbalance", "communication"):
        style = SEVERITY_STYLES.get(d.verdict.severity, "")
        head.append(
            Text(f"● {d.verdict.evidence[0]}", style=f"bold {style}", no_wrap=True, overflow="ellipsis")
        )
        head += [
            Text(f"  {e}", style=style, no_wrap=True, overflow="ellipsis") for e in d.verdict.evidence[1:]
        ]
        how = persistence(job, straggler).text(straggler) if straggler is not None else ""
        if how:
            head.append(Text(f"  {how}", style=style, no_wrap=True, overflow="ellipsis"))
    elif times:
        head.append(Text("● no straggler: no rank makes the others wait", style="green"))
    if now is not None and (job.relays or len(job.ranked()) > MANY_FOR_COVERAGE):
        c = coverage(job, now)
        style = "green" if c.reporting == c.expected else "yellow" if c.reporting else "red"
        head.append(Text(f"◆ {coverage_line(c)}", style=style, no_wrap=True, overflow="ellipsis"))
    versions = job.versions()
    if len(versions) > 1:
        which = "; ".join(f"{v} on ranks {ranks_text(r)}" for v, r in versions.items())
        head.append(Text(f"⚑ the ranks run different torchtop versions: {which}", style="yellow"))
    head += [Text(f"⚑ {n}", style="yellow", no_wrap=True, overflow="ellipsis") for n in job.notes]
    head.append(Text(""))
    return head


BULLETS = ("● ", "◆ ", "⚑ ")  # a line's mark: its wrapped lines start under the words after it


def wrap_line(text: Text, width: int) -> list[Text]:
    """`text` broken at spaces into lines of at most `width` cells (a word longer than that is
    broken inside), each line after the first indented under the first's words."""
    plain = text.plain
    if width <= 0 or text.cell_len <= width:
        return [text]
    indent = len(plain) - len(plain.lstrip(" "))
    indent += 2 if plain[indent:].startswith(BULLETS) else 0
    indent = min(indent, width // 2)
    out: list[Text] = []
    start, limit = 0, width
    while start < len(plain):
        end = len(plain)
        if end - start > limit:
            # a group break (three spaces) in the line's second half first: a label stays with
            # its figures ("scaling: compute 85%  comm 9%" moves down whole, not its last word)
            cut = plain.rfind("   ", start + limit // 2, start + limit + 1)
            if cut < 0:
                cut = plain.rfind(" ", start + 1, start + limit + 1)
            end = cut if cut > start else start + limit
        piece = text[start:end]
        piece.rstrip()
        out.append(piece if not out else Text(" " * indent) + piece)
        start, limit = end, width - indent
        while start < len(plain) and plain[start] == " ":
            start += 1
    return out


def fit_head(head: list[Text], width: int, room: int) -> list[Text]:
    """The head's lines wrapped at `width`, whole; where they and the ranks would not fit the
    `room` lines on screen, the verdict's later evidence lines go (the last first: the Overview
    tab's verdict has them all) so that every rank shows, as long as that is enough."""
    groups = [wrap_line(t, width) for t in head]
    size = sum(len(g) for g in groups)
    optional = [k for k, t in enumerate(head) if t.plain.startswith("  ") or not t.plain.strip()]
    keep = size - sum(len(groups[k]) for k in optional[1:]) + 1  # the first evidence line, a hint
    if room <= 0 or size <= room or keep > room:
        return [line for g in groups for line in g]
    dropped: set[int] = set()
    for k in reversed(optional[1:]):
        if size + (1 if any(head[j].plain.strip() for j in dropped | {k}) else 0) <= room:
            break
        dropped.add(k)
        size -= len(groups[k])
    out = [line for k, g in enumerate(groups) if k not in dropped for line in g]
    hidden = sum(1 for k in dropped if head[k].plain.strip())
    if hidden:
        out.append(Text(f"  (+{hidden} more: the Overview tab's verdict)", style="dim"))
    return out


@dataclass
class Layout:
    """The panel's lines, a rank's row made when first read: at 1,024 ranks the screen shows
    some 30 of them (render_line), so a refresh makes those, not 1,024 rows of text."""

    made: list[Text | Callable[[], Text]]
    keys: list[str | None]  # the member shown on each line (None: not a rank)

    def line(self, y: int) -> Text:
        got = self.made[y]
        if not isinstance(got, Text):
            got = self.made[y] = got()
        return got

    @property
    def lines(self) -> list[Text]:
        return [self.line(y) for y in range(len(self.made))]

    def __len__(self) -> int:
        return len(self.made)

    def under(self, head: list[Text]) -> Layout:
        """This layout below `head` (a layout's lines never depend on the head above them)."""
        return Layout([*head, *self.made], [*([None] * len(head)), *self.keys])


def layout(view: RanksView, head: list[Text], compact: bool = False) -> Layout:
    """The panel's lines. `compact` (a narrow terminal, 80 columns): one row a rank, the slowest
    first, so the ranks that matter show without scrolling."""
    if compact and view.rows:
        return _compact(view, head)
    lines: list[Text | Callable[[], Text]] = list(head)
    keys: list[str | None] = [None] * len(head)
    if not view.rows:
        lines.append(Text("waiting for the ranks' first steps…", style="dim"))
        return Layout(lines, [*keys, None])
    slow = view.slowest[0] if view.slowest else None
    by_rank = {r.rank: r for r in view.rows}

    def add(text: Text | Callable[[], Text], key: str | None = None) -> None:
        lines.append(text)
        keys.append(key)

    add(header_line(view.bucket_s))
    add(_cells(None, view.median, "median", "", False))
    if len(view.rows) > MANY and view.slowest:
        add(
            Text(
                f"slowest {min(TOP_K, len(view.slowest))} (own time: the step less its collective wait)",
                style="bold",
            )
        )
        for r in view.slowest[:TOP_K]:
            row = by_rank[r]
            add(partial(_cells, row, view.median, str(r), row.node, r == slow), row.key)
    for node, ranks in view.nodes.items():
        if len(view.rows) > MANY or len(view.nodes) > 1:
            add(partial(_node_line, node, len(ranks)))
        for r in ranks:
            row = by_rank[r]
            mark = r == slow and len(view.rows) > 1
            add(partial(_cells, row, view.median, str(r), row.node, mark), row.key)
    return Layout(lines, keys)


def _node_line(node: str, ranks: int) -> Text:
    return Text(f"{node or '?'} · {ranks} {fmt.plural(ranks, 'rank')}", style="bold")


def _compact(view: RanksView, head: list[Text]) -> Layout:
    lines: list[Text | Callable[[], Text]] = [*head, header_line(view.bucket_s, True, len(view.nodes) > 1)]
    keys: list[str | None] = [None] * (len(head) + 1)
    nodes = len(view.nodes) > 1
    lines.append(_cells(None, view.median, "median", "" if not nodes else "", False, True))
    keys.append(None)
    by_rank = {r.rank: r for r in view.rows}
    order = [*view.slowest, *(r.rank for r in view.rows if r.rank not in view.slowest)]
    slow = view.slowest[0] if view.slowest and len(view.rows) > 1 else None
    for r in order:
        row = by_rank[r]
        lines.append(partial(_cells, row, view.median, str(r), row.node if nodes else "", r == slow, True))
        keys.append(row.key)
    return Layout(lines, keys)


class RanksPanel(Widget):
    """Every rank of the job; click a rank to show it in the other tabs.

    `show(view, head)` lays the lines out once; the panel relayouts the screen only when its
    number of lines changes (a refresh of 64 ranks' figures is a repaint, not a new layout)."""

    @dataclass
    class Chosen(Message):
        key: str

    def __init__(self, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(**kwargs)
        self.view = RanksView()
        self.head: list[Text] = []
        self._layout = layout(self.view, self.head)

    @property
    def compact(self) -> bool:
        width = self.content_size.width
        return 0 < width < COMPACT_BELOW

    def show(self, view: RanksView, head: list[Text]) -> None:
        grew = len(self._layout)
        self.view, self.head = view, head
        width, compact = self.content_size.width, self.compact
        room = self.parent.content_size.height - 2 if isinstance(self.parent, Widget) else 0  # less borders
        table = layout(view, [], compact)
        self._layout = table.under(fit_head(head, width, room - len(table)))  # whole lines, never "…"
        self.refresh(layout=len(self._layout) != grew)

    def on_resize(self, _event: events.Resize) -> None:
        self.show(self.view, self.head)

    def render(self) -> RenderableType:
        text = Text("\n").join(self._layout.lines)
        text.no_wrap, text.overflow = True, "ellipsis"  # one line each: clicks map lines to ranks
        return text

    def render_line(self, y: int) -> Strip:
        """Line `y` alone, as render() would draw it: the screen asks only for the lines it shows
        (a 1,024-rank table is some 1,100 lines, of which 30 are on screen)."""
        width = self.size.width
        if 0 <= y < len(self._layout):
            text = Text("").join([self._layout.line(y)])  # its style a span, as in render()'s join
            text.no_wrap, text.overflow = True, "ellipsis"
            visual = visualize(self, text, markup=self._render_markup)
            strips = Visual.to_strips(self, visual, width, 1, self.visual_style)
            if strips:
                return strips[0].apply_offsets(0, y)  # the line's place in the text (selection)
        return Strip.blank(width, self.visual_style.rich_style)

    def get_content_height(self, container, viewport, width) -> int:  # type: ignore[no-untyped-def]
        return max(1, len(self._layout))

    def on_click(self, event: events.Click) -> None:
        offset = event.get_content_offset(self)
        if offset is None:
            return
        keys = self._layout.keys
        if 0 <= offset.y < len(keys) and keys[offset.y] is not None:
            self.post_message(self.Chosen(keys[offset.y]))  # type: ignore[arg-type]

    def plain(self) -> str:
        return "\n".join(t.plain for t in self._layout.lines)
