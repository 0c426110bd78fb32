"""The `?` screen: the keys, and what the panels measure (so nobody has to guess)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

HELP = """\
[b]Keys[/b]
  [b]q[/b]        quit (training goes on)
  [b]1 2 3[/b]    tabs: overview · memory · GPU and host
  [b]p[/b]        profile the next N steps (torch.profiler trace, .json.gz)
  [b]+ -[/b]      change N (default 5, at most 100)
  [b]m[/b]        CUDA memory snapshot of the next N steps (a pickle for
           pytorch.org/memory_viz)
  [b]c[/b]        captures: past traces and snapshots, summaries, file paths
  [b]?[/b]        this help
  [b]escape[/b]   close this help

[b]Job view[/b] (every rank of a job: several targets, or a job here)
  [b]0[/b]        the Ranks tab: every rank against the median rank
  [b]j[/b]        the other tabs show the job (the mean of its ranks)
  [b][ ][/b]      ... the previous / next rank;  [b]s[/b] the slowest
  click     ... the rank clicked in the Ranks tab
  [b]p m[/b]      the same N steps on every rank (or the rank shown)

[b]Panels[/b]
  [b]step time[/b]   now / median / p90 of the training steps that ended
              in the last 10 s of the agent's clock, and steps per second
  [b]verdict[/b]     data-loading, transfer, compute or host-overhead bound,
              with the numbers and what to try; flags for memory pressure,
              fragmentation, DataLoader workers, memory growth
  [b]phases[/b]      host time per step in data (dataloader wait), h2d
              (host-to-device copies), forward, backward, optimizer,
              comm (waiting in collectives: DDP's all-reduce at the end
              of backward, blocking torch.distributed calls) and other
              (the rest of the step); device ms are CUDA-event times on
              sampled steps
  [b]marks[/b]       values from torchtop.agent.mark("loss", loss)
  [b]memory[/b]      CUDA caching allocator: allocated / reserved / peak of
              the device, fragmentation (largest free block, external %)
  [b]GPU, host[/b]   NVML per GPU; process and system CPU and memory, and
              each child process (DataLoader workers flagged)
  [b]status[/b]      gaps: batches lost between agent and monitor;
              dropped: step records the agent's buffer dropped"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [
        Binding("escape", "close", "Close"),
        Binding("question_mark", "close", "Close"),
    ]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-box"):
            yield Static(HELP, id="help-text")

    def on_mount(self) -> None:
        self.query_one("#help-box").border_title = "torchtop help"

    def action_close(self) -> None:
        self.dismiss(None)
