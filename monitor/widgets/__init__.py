"""The TUI's panels, one job each; the app pushes plain values into their reactive attributes."""

from .chooser import ChooserScreen
from .help_screen import HelpScreen
from .phase_panel import PHASE_COLOURS, PhasePanel, phase_bar
from .run_header import RunHeader
from .status_line import StatusLine
from .step_panel import StepPanel

__all__ = ["ChooserScreen", "HelpScreen", "PHASE_COLOURS", "PhasePanel", "RunHeader", "StatusLine", "StepPanel", "phase_bar"]
