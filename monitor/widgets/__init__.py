"""The TUI's panels, one job each; the app pushes plain values into their reactive attributes."""

from .capture_line import CaptureLine
from .captures_screen import CapturesScreen
from .chooser import ChooserScreen
from .gpu_panel import GpuPanel
from .help_screen import HelpScreen
from .host_panel import HostFigures
from .log_tail import LogTail
from .marks_panel import MarksPanel
from .memory_panel import MemoryFigures
from .memory_plot import MemoryPlot
from .phase_panel import PHASE_COLOURS, PhasePanel, phase_bar
from .run_header import RunHeader
from .status_line import StatusLine
from .step_panel import StepPanel
from .verdict_panel import VerdictPanel
from .worker_table import WorkerTable

__all__ = [
    "CaptureLine", "CapturesScreen", "ChooserScreen", "GpuPanel", "HelpScreen", "HostFigures", "LogTail", "MarksPanel",
    "MemoryFigures", "MemoryPlot", "PHASE_COLOURS", "PhasePanel", "RunHeader", "StatusLine", "StepPanel",
    "VerdictPanel", "WorkerTable", "phase_bar",
]
