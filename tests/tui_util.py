"""What the TUI tests share: synthetic steps and host figures with known values, and, for the
tests that run a real agent, the training script and a bounded wait."""

from __future__ import annotations

import time

from torchtop.contract import wire
from torchtop.monitor.model.steps import StepKind, StepRecord

GIB, MIB = 2**30, 2**20
T0 = 1_000.0


#: A small CPU training loop with the agent, for `seconds` (argv[1]); it marks its loss.
TRAIN = """
import sys, time, torch, torchtop.agent
torchtop.agent.start()
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(256, 32)), batch_size=16)
end = time.time() + float(sys.argv[1])
while time.time() < end:
    for (x,) in data:
        loss = model(x).square().mean()
        opt.zero_grad(); loss.backward(); opt.step()
        torchtop.agent.mark("loss", loss)
        time.sleep(0.005)
"""


async def wait_for(pilot, condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        await pilot.pause(0.2)
    return condition()


def steps(
    n: int = 60,
    data: float = 0.30,
    wall_ms: float = 10.0,
    marks: bool = False,
    first: int = 0,
    kind: StepKind = "train",
    skipped_every: int = 0,
) -> list[StepRecord]:
    """`n` steps of `wall_ms`, `data` of it waiting on the loader, the rest split over compute."""
    out = []
    wall = int(wall_ms * 1e6)
    for k in range(n):
        phases = {
            "data": int(wall * data),
            "forward": int(wall * (1 - data) * 0.5),
            "backward": int(wall * (1 - data) * 0.4),
            "optimizer": int(wall * (1 - data) * 0.05),
        }
        phases["other"] = wall - sum(phases.values())
        extra: dict = {}
        if marks:
            extra["marks"] = {"loss": 2.0 / (first + k + 1), "lr": 0.001}
        if skipped_every and k % skipped_every == 0:
            extra["skipped"] = 1
        out.append(
            StepRecord(
                i=first + k,
                t0=T0 + (first + k) * wall_ms / 1e3,
                wall_ns=wall,
                phases=phases,
                kind=kind,
                **extra,
            )
        )
    return out


HOST = wire.HostSample(
    proc_cpu=143.0,
    proc_rss=2 * GIB + 512 * MIB,
    threads=24,
    cpu_count=8,
    cpu_per_core=[10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 90.0, 100.0],
    mem_total=64 * GIB,
    mem_available=32 * GIB,
    mem_percent=50.0,
    workers=[
        wire.WorkerSample(pid=103, cpu_percent=1.0, rss=50 * MIB, name="python"),
        wire.WorkerSample(pid=101, cpu_percent=98.0, rss=300 * MIB, name="pt_data_worker", dataloader=True),
        wire.WorkerSample(pid=102, cpu_percent=94.0, rss=310 * MIB, name="pt_data_worker", dataloader=True),
    ],
)


def screen_text(app) -> str:  # type: ignore[no-untyped-def]
    """The whole screen as plain text, as a terminal would show it (what snapshot SVGs hold)."""
    import io

    from rich.console import Console

    width, height = app.size
    console = Console(
        width=width,
        height=height,
        file=io.StringIO(),
        force_terminal=True,
        color_system=None,
        record=True,
        legacy_windows=False,
        safe_box=False,
    )
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return console.export_text()


BORDERS = set("│┃╭╮╰╯┏┓┗┛")


def outside_the_panels(text: str) -> list[tuple[int, str]]:
    """(row, what) for anything but spaces right of a line's last panel border: a stray glyph
    (a scrollbar's eighth block, say) where no panel is."""
    out = []
    for row, line in enumerate(text.splitlines()):
        last = max((i for i, ch in enumerate(line) if ch in BORDERS), default=-1)
        if last >= 0 and line[last + 1 :].strip():
            out.append((row, line[last + 1 :]))
    return out
