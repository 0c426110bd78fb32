"""torchtop's monitor: the terminal UI and the command line. Never imports torch."""
