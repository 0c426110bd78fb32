"""The header: which run this is (pid, host, device, uptime, rank, torch, run id, command).

One line where it fits; otherwise two, so a narrow terminal (80 columns) still shows the torch
version and the command: the first line says where and what (pid, device, uptime, rank, torch),
the second which run (run id, command), each cut with an ellipsis only at its end.
"""

from __future__ import annotations

from rich.console import RenderableType
from rich.text import Text
from textual import events
from textual.reactive import reactive
from textual.widget import Widget

from torchtop.agent.contract.wire import Hello
from torchtop.monitor.model import fmt

BADGE = " torchtop "


def _pairs(text: Text, parts: list[tuple[str, str]]) -> None:
    for label, value in parts:
        text.append(f"  {label} " if label else "  ", style="dim")
        text.append(value, style="bold")


def header_lines(hello: Hello | None, target: str, age_s: float, width: int = 200) -> list[Text]:
    """The header as one line if it fits in `width` cells, else two."""
    first = Text(no_wrap=True, overflow="ellipsis")
    first.append(BADGE, style="bold reverse")
    if hello is None:
        first.append(f"  {target or 'no agent chosen'}", style="dim")
        return [first]
    device = hello.device + (f" ({hello.device_name})" if hello.device_name else "")
    where: list[tuple[str, str]] = [
        ("pid", f"{hello.pid} @ {hello.host}"),
        ("device", device),
        ("up", fmt.duration(age_s)),
    ]
    if hello.world_size > 1:
        where.append(("rank", f"{hello.rank}/{hello.world_size}"))
    if hello.torch_version:
        where.append(("torch", hello.torch_version))
    which = [("run", hello.run_id)]
    command = " ".join(hello.argv)
    _pairs(first, where)
    one = first.copy()
    _pairs(one, which)
    if command:
        one.append(f"  {command}", style="dim")
    # decided as if the uptime were 7 cells wide, so its growth never changes the height
    if one.cell_len - len(fmt.duration(age_s)) + 7 <= width:
        return [one]
    second = Text(no_wrap=True, overflow="ellipsis")
    second.append(" " * len(BADGE))
    _pairs(second, which)
    if command:
        second.append(f"  {command}", style="dim")
    return [first, second]


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
