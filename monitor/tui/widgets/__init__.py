"""The TUI's panels, one job each; the app pushes plain values into their reactive attributes."""

from torchtop.monitor.tui.widgets.capture_line import CaptureLine
from torchtop.monitor.tui.widgets.captures_screen import CapturesScreen
from torchtop.monitor.tui.widgets.chooser import ChooserScreen
from torchtop.monitor.tui.widgets.gpu_panel import GpuPanel
from torchtop.monitor.tui.widgets.help_screen import HelpScreen
from torchtop.monitor.tui.widgets.host_figures import HostFigures
from torchtop.monitor.tui.widgets.key_bar import KeyBar
from torchtop.monitor.tui.widgets.log_tail import LogTail
from torchtop.monitor.tui.widgets.marks_panel import MarksPanel
from torchtop.monitor.tui.widgets.memory_panel import MemoryFigures
from torchtop.monitor.tui.widgets.memory_plot import MemoryPlot
from torchtop.monitor.tui.widgets.phase_panel import PHASE_COLOURS, PhasePanel, phase_bar
from torchtop.monitor.tui.widgets.run_header import RunHeader
from torchtop.monitor.tui.widgets.status_line import StatusLine
from torchtop.monitor.tui.widgets.step_panel import StepPanel
from torchtop.monitor.tui.widgets.verdict_panel import VerdictPanel
from torchtop.monitor.tui.widgets.why_panel import WhyPanel
from torchtop.monitor.tui.widgets.worker_table import WorkerTable

__all__ = [
    "CaptureLine",
    "CapturesScreen",
    "ChooserScreen",
    "GpuPanel",
    "HelpScreen",
    "HostFigures",
    "KeyBar",
    "LogTail",
    "MarksPanel",
    "MemoryFigures",
    "MemoryPlot",
    "PHASE_COLOURS",
    "PhasePanel",
    "RunHeader",
    "StatusLine",
    "StepPanel",
    "VerdictPanel",
    "WhyPanel",
    "WorkerTable",
    "phase_bar",
]
