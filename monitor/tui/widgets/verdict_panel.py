"""Verdict panel: what holds the run back, in plain words, with the numbers and what to do next.

The app sets `diagnosis` (from `judge.diagnose`, at the panel refresh rate, keeping the previous
one for hysteresis); the panel only words and colours it. Its CSS class names the severity
(`-ok`, `-info`, `-warning`, `-critical`, `-unknown`), so the border colour comes from app.tcss.
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from torchtop.monitor.diagnosis.catalogue import FLAG_WORDS, VERDICT_WORDS
from torchtop.monitor.diagnosis.facts import Diagnosis, Finding
from torchtop.monitor.model import fmt

#: Rich style per severity; the 16 standard colours so a 16-colour terminal matches.
SEVERITY_STYLES = {
    "ok": "green",
    "info": "cyan",
    "warning": "yellow",
    "critical": "red",
    "unknown": "bright_black",
}
SEVERITY_CLASSES = tuple(f"-{s}" for s in SEVERITY_STYLES)


def verdict_title(d: Diagnosis | None) -> str:
    """The panel's title names the step time its figures are of (the judged steps' mean), apart
    from the step panel's median over its own window."""
    if d is None or not d.steps:
        return "verdict"
    unit = "pass" if d.inference else "step"
    mean = f" · mean {fmt.ms(d.step_ms)} ms a {unit}" if d.step_ms > 0 else ""
    if d.ranks > 1:  # a job's: its ranks' own steps pooled, said as steps a rank
        each = round(d.steps / d.ranks)
        return f"verdict · {each} {fmt.plural(each, 'step')} × {d.ranks} ranks judged{mean}"
    many = (
        fmt.plural(d.steps, "forward pass", "forward passes") if d.inference else fmt.plural(d.steps, "step")
    )
    return f"verdict · {d.steps} {many} judged{mean}"


def severity_class(d: Diagnosis | None) -> str:
    """The panel's CSS class: the verdict's severity, or -unknown while warming up."""
    if d is None or d.verdict.kind == "unknown":
        return "-unknown"
    return f"-{d.verdict.severity}"


def _style(f: Finding) -> str:
    return SEVERITY_STYLES["unknown" if f.kind == "unknown" else f.severity]


def verdict_rows(d: Diagnosis | None) -> list[tuple[Text, Text]]:
    """(marker, line) rows: headline, evidence (the numbers), 1-3 advice lines, each flag with its
    top evidence. The marker column keeps wrapped lines indented under their own text."""
    if d is None:
        return [(Text(""), Text("no verdict yet: waiting for steps", style="dim"))]
    v = d.verdict
    headline, meaning = VERDICT_WORDS.get(v.kind, (v.kind, ""))
    style = _style(v)
    title = Text()
    title.append(headline, style=f"bold {style}")
    if v.kind != "unknown":
        title.append(f"  {v.severity}", style=style)
    if meaning:
        title.append(f"  {meaning}", style="dim")
    rows = [(Text("●", style=f"bold {style}"), title)]
    rows += [(Text("  •", style=style), Text(line)) for line in v.evidence]
    rows += [(Text("  →", style="bold"), Text(line, style="italic")) for line in v.advice[:3]]
    if v.upside is not None:
        rows.append((Text("  ↑", style="bold"), Text(v.upside.text)))
    for flag in d.flags:
        fs = _style(flag)
        row = Text.assemble((FLAG_WORDS.get(flag.kind, flag.kind), f"bold {fs}"), (f" {flag.severity}", fs))
        if flag.evidence:
            row.append(f": {flag.evidence[0]}")
        rows.append((Text("  ⚑", style=f"bold {fs}"), row))
        # a flag's upside is said once: not again where the verdict already says the same
        if flag.upside is not None and (v.upside is None or flag.upside.text != v.upside.text):
            rows.append((Text("  ↑", style="dim"), Text(flag.upside.text, style="dim")))
    return rows


def verdict_table(d: Diagnosis | None) -> Group:
    """The headline as a line, then the other rows in a grid under it."""
    (marker, headline), *rest = verdict_rows(d)
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True)
    grid.add_column(ratio=1)
    for m, line in rest:
        grid.add_row(m, line)
    if not marker.plain:
        return Group(headline, grid)
    top = Table.grid(padding=(0, 1))  # a headline that wraps stays right of its marker
    top.add_column(no_wrap=True)
    top.add_column(ratio=1)
    top.add_row(marker, headline)
    return Group(top, grid)


class VerdictPanel(Widget):
    """The diagnosis of the recent window."""

    diagnosis: reactive[Diagnosis | None] = reactive(None, layout=True)

    def on_mount(self) -> None:
        self.border_title = "verdict"
        self.add_class("-unknown")

    def watch_diagnosis(self, d: Diagnosis | None) -> None:
        wanted = severity_class(d)
        for cls in SEVERITY_CLASSES:
            self.set_class(cls == wanted, cls)
        self.border_title = verdict_title(d)

    def render(self) -> RenderableType:
        return verdict_table(self.diagnosis)

    def plain(self) -> str:
        """What the panel says, as plain text, one row a line (tests, screen readers)."""
        return "\n".join(f"{marker.plain} {line.plain}" for marker, line in verdict_rows(self.diagnosis))
