"""Memory over time: allocated and reserved CUDA memory (or, on CPU, process RSS) as a plot.

The app sets `series` (panel_data.memory_series, at most a terminal's width of points); the
plot is rebuilt only when the series changes and drawn only while its tab is on screen.
"""

from __future__ import annotations

from textual.reactive import reactive
from textual_plotext import PlotextPlot

from torchtop.monitor.model.panel_data import PlotSeries, y_top

#: Line colour per series: plotext names of the 16 standard colours.
LINE_COLOURS = {"allocated": "cyan", "reserved": "magenta", "process RSS": "cyan"}


class MemoryPlot(PlotextPlot):
    series: reactive[PlotSeries | None] = reactive(None, always_update=False)

    def watch_series(self, series: PlotSeries | None) -> None:
        plt = self.plt
        plt.clear_data()
        plt.clear_figure()
        if series is None or not series.xs:
            plt.title("no memory samples yet")
            self.refresh()
            return
        for name, values in series.lines.items():
            plt.plot(series.xs, values, label=name, marker="braille", color=LINE_COLOURS.get(name, "white"))
        plt.ylim(0, y_top(series))
        plt.xlim(min(series.xs), 0)
        plt.xlabel("seconds (0 = now)")
        plt.ylabel(series.unit)
        self.refresh()
