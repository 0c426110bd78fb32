"""The training process's children as a table — DataLoader workers flagged — with CPU % and RSS.

When a run is data-bound, this is the first place to look: workers near 100% CPU are saturated.
The app sets `processes` (panel_data.worker_rows order); rows are rebuilt only when they change.
"""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widgets import DataTable

from torchtop.contract.wire import WorkerSample
from torchtop.monitor.diagnosis.facts import THRESHOLDS, worker_busy
from torchtop.monitor.model import fmt

COLUMNS = ("pid", "name", "role", "CPU %", "RSS")


def worker_cells(w: WorkerSample) -> tuple[str | Text, ...]:
    busy = (worker_busy(w.cpu_percent, w.wait_percent) or 0.0) >= THRESHOLDS.worker_saturated
    role = Text("DataLoader worker", style="bold cyan") if w.dataloader else Text("child", style="dim")
    cpu = Text(f"{w.cpu_percent:.0f}", style="bold yellow" if busy and w.dataloader else "", justify="right")
    return str(w.pid), w.name or "?", role, cpu, Text(fmt.size(w.rss), justify="right")


class WorkerTable(DataTable):
    processes: reactive[list[WorkerSample]] = reactive(list)

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.zebra_stripes = False
        for name in COLUMNS:
            self.add_column(name, key=name)
        self.watch_processes(self.processes)

    def watch_processes(self, workers: list[WorkerSample]) -> None:
        if not self.columns:
            return
        self.clear()
        self.add_rows([worker_cells(w) for w in workers])
        loaders = sum(1 for w in workers if w.dataloader)
        self.border_title = (
            f"child processes · {loaders} DataLoader workers" if workers else "child processes · none"
        )

    def rows_text(self) -> list[list[str]]:
        """The table as plain strings, row by row (tests)."""
        return [[str(getattr(c, "plain", c)) for c in self.get_row_at(i)] for i in range(self.row_count)]
