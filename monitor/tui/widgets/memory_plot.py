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
        top = y_top(series)
        plt.ylim(0, top)
        plt.xlim(min(series.xs), 0)
        # units on the ticks themselves: plotext's axis labels sit on its last row, the first
        # to go when the plot is short (80x24)
        ys = [top * k / 4 for k in range(5)]
        plt.yticks(ys, [f"{y:.3g} {series.unit}" for y in ys])
        span = -min(series.xs)
        xs = [-span * k / 4 for k in range(4, -1, -1)]
        plt.xticks(xs, [tick_seconds(x, span) for x in xs])
        self.refresh()


def tick_seconds(x: float, span: float) -> str:
    """An x tick: seconds before the latest point (tenths on a plot under 10 s), `now` at 0."""
    if x == 0:
        return "now"
    return f"{x:.1f} s" if span < 10 else f"{x:.0f} s"
