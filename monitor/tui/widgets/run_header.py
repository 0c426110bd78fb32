"""One header line: which run this is (pid, host, device, run id) from the agent's hello."""

from __future__ import annotations

from rich.console import RenderableType
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from torchtop.agent.contract.wire import Hello
from torchtop.monitor.model import fmt


def header_text(hello: Hello | None, target: str, age_s: float) -> Text:
    text = Text(no_wrap=True, overflow="ellipsis")
    text.append(" torchtop ", style="bold reverse")
    if hello is None:
        text.append(f"  {target or 'no agent chosen'}", style="dim")
        return text
    device = hello.device + (f" ({hello.device_name})" if hello.device_name else "")
    parts: list[tuple[str, str]] = [
        ("pid", f"{hello.pid} @ {hello.host}"),
        ("device", device),
        ("run", hello.run_id),
        ("up", fmt.duration(age_s)),
    ]
    if hello.world_size > 1:
        parts.append(("rank", f"{hello.rank}/{hello.world_size}"))
    if hello.torch_version:
        parts.append(("torch", hello.torch_version))
    for label, value in parts:
        text.append(f"  {label} ", style="dim")
        text.append(value, style="bold")
    if hello.argv:
        text.append("  " + " ".join(hello.argv), style="dim")
    return text


class RunHeader(Widget):
    hello: reactive[Hello | None] = reactive(None)
    target: reactive[str] = reactive("")
    age_s: reactive[float] = reactive(0.0)

    def render(self) -> RenderableType:
        return header_text(self.hello, self.target, self.age_s)
