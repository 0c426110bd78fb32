"""The Textual TUI: the app, its feed worker and its widgets."""
