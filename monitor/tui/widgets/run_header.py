"""The header: which run this is (pid, host, device, uptime, rank, torch, command, run id).

One line where it fits; otherwise two, so a narrow terminal (80 columns) still shows the torch
version and the command: the figures fill the first line in order of importance (pid and host,
device, uptime, rank, torch) and what does not fit starts the second, before the command and
the run id; only those two are ever cut (with an ellipsis, at the end).
"""

from __future__ import annotations

from rich.console import RenderableType
from rich.text import Text
from textual import events
from textual.reactive import reactive
from textual.widget import Widget

from torchtop.contract.wire import Hello
from torchtop.monitor.model import fmt

BADGE = " torchtop "
UPTIME_CELLS = 7  # the longest uptime ("10d 04h"): the layout never changes as it grows


def _pair(label: str, value: str) -> Text:
    return Text.assemble((f"  {label} " if label else "  ", "dim"), (value, "bold"))


def _items(hello: Hello, uptime: str, short: bool) -> list[Text]:
    """The header's figures in order of importance; `short` drops the pid and device labels and
    the host's domain (a cluster node's long name)."""
    host = hello.host.split(".")[0] if short else hello.host
    device = hello.device + (f" ({hello.device_name})" if hello.device_name else "")
    items = [_pair("" if short else "pid", f"{hello.pid} @ {host}"), _pair("" if short else "device", device)]
    items.append(_pair("up", uptime))
    if hello.world_size > 1:
        items.append(_pair("rank", f"{hello.rank}/{hello.world_size}"))
    if hello.torch_version:
        items.append(_pair("torch", hello.torch_version))
    if hello.argv:
        items.append(Text("  " + " ".join(hello.argv), style="dim"))
    items.append(_pair("run", hello.run_id))
    return items


def _join(parts: list[Text]) -> Text:
    return Text("", no_wrap=True, overflow="ellipsis").join(parts)


def header_lines(hello: Hello | None, target: str, age_s: float, width: int = 200) -> list[Text]:
    """The header as one line if it fits in `width` cells, else two (see the module's doc)."""
    badge = Text(BADGE, style="bold reverse")
    if hello is None:
        return [_join([badge, Text(f"  {target or 'no agent chosen'}", style="dim")])]
    uptime = fmt.duration(age_s)
    slack = UPTIME_CELLS - len(uptime)  # decided as if the uptime were at its widest
    tail = 2 if hello.argv else 1  # the command and the run id: the end of the second line
    indent = Text(" " * (len(BADGE) - 2))
    lines: list[Text] = []
    for short in (False, True):
        items = _items(hello, uptime, short)
        line = _join([badge, *items])
        if line.cell_len + slack <= width:
            return [line]
        split = 1  # the first line takes what fits, in order; the command and run id go below
        while split < len(items) - tail and _join([badge, *items[: split + 1]]).cell_len + slack <= width:
            split += 1
        lines = [_join([badge, *items[:split]]), _join([indent, *items[split:]])]
        below = _join([indent, *items[split : len(items) - tail]])  # what must fit whole
        if lines[0].cell_len + slack <= width and below.cell_len + slack <= width:
            return lines
    return lines


def header_text(hello: Hello | None, target: str, age_s: float, width: int = 200) -> Text:
    return Text("\n", no_wrap=True, overflow="ellipsis").join(header_lines(hello, target, age_s, width))


class RunHeader(Widget):
    """Its height (1 or 2 lines) is set from its width and the hello, on either's change."""

    hello: reactive[Hello | None] = reactive(None)
    target: reactive[str] = reactive("")
    age_s: reactive[float] = reactive(0.0)

    def _fit(self) -> None:
        self.styles.height = len(header_lines(self.hello, self.target, self.age_s, self.size.width or 200))

    def watch_hello(self) -> None:
        self._fit()

    def on_resize(self, _event: events.Resize) -> None:
        self._fit()

    def render(self) -> RenderableType:
        return header_text(self.hello, self.target, self.age_s, self.size.width or 200)
