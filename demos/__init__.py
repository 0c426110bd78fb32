"""Demo training jobs that show torchtop on a real loop, one module per scenario.

Run one with `torchtop demo --scenario NAME` (it opens the TUI on it) or directly with
`python -m torchtop.demos.NAME`. Every module here whose name does not start with `_` and is not
listed in `HELPERS` is a scenario; its docstring's first line is its description.

This package's `__init__` imports nothing but `warnings`: the monitor lists scenarios without
importing torch. It runs before a scenario imports torch (`python -m torchtop.demos.NAME`), so
it can keep one warning out of the demos: torch's "Failed to initialize NumPy" at import when
NumPy is absent. Neither torch nor torchtop needs NumPy, the demos use none, and a user did not
cause that line; every other warning, torch's included, still shows.
"""

import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning, module="torch")

#: Modules of this package that are shared code, not scenarios. A literal: the monitor reads it
#: with `ast` (in an editable install this package is a namespace and this file never runs).
HELPERS = ("common", "data")
