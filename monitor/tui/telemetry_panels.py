"""The memory, GPU and host panels of the dashboard (tui/app.py), filled from the latest samples;
the memory plot only while its tab is shown, and at most once every PLOT_REFRESH_S."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from torchtop.monitor.model import fmt
from torchtop.monitor.model.energy import window_energy
from torchtop.monitor.model.panel_data import PLOT_S, memory_series, worker_rows, y_top
from torchtop.monitor.model.state import recent_points, retry_rate

if TYPE_CHECKING:
    from torchtop.monitor.tui.app import TorchtopApp

PLOT_REFRESH_S = 1.0  # the memory plot (5 minutes wide) is redrawn at most this often
NO_TELEMETRY = "no telemetry received yet"


def fill(app: TorchtopApp, window_s: float) -> None:
    """The latest samples into the memory, GPU and host panels (the plot only while shown);
    `window_s`: the seconds the retry rate is taken over (the panels' window)."""
    state = app.state
    tel = state.telemetry
    missing = tel.unavailable if tel is not None else {}
    mem = app.memory_figures
    mem.memory = tel.memory if tel is not None else []
    mem.frag = tel.frag if tel is not None else []
    mem.peak_window = dict(state.peak_window)
    mem.retry_rate = retry_rate(state, window_s)
    mem.reason = missing.get("memory", "") if tel is not None else NO_TELEMETRY
    oom = app.diagnosis.oom if app.diagnosis is not None else None
    mem.forecast = oom.text() if oom is not None else ""
    if app._tab() == "memory" and time.perf_counter() >= app._plot_due:
        # plotext takes milliseconds to draw: once a second keeps it a small share of a core
        app._plot_due = time.perf_counter() + PLOT_REFRESH_S
        total = tel.memory[0].device_total if tel is not None and tel.memory else 0
        cuda = bool(tel is not None and tel.memory)
        series = memory_series(recent_points(state, PLOT_S), cuda, total)
        app.memory_plot.series = series
        full = bool(series.limit) and y_top(series) == series.limit
        app.query_one("#memory-panel").border_subtitle = (
            f"plot: last {PLOT_S / 60:.0f} min{', top =' if full else ' ·'} device total {fmt.size(total)}"
            if cuda
            else "no CUDA: the plot shows the process RSS"
        )
    app.gpu_panel.gpus = tel.gpus if tel is not None else []
    app.gpu_panel.reason = missing.get("gpu", "") if tel is not None else NO_TELEMETRY
    if app._tab() == "gpu-host":  # the window's joules a step: only while shown
        summary = state.summary(window_s)
        app.gpu_panel.energy = window_energy(state.points, summary.in_full, summary)
    app.host_figures.host = tel.host if tel is not None else None
    app.host_figures.reason = missing.get("host", "") if tel is not None else NO_TELEMETRY
    app.worker_table.processes = worker_rows(tel.host if tel is not None else None)
