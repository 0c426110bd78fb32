"""torchtop's in-process agent: measures every training step, publishes it over ZeroMQ.

    import torchtop.agent
    torchtop.agent.start()     # returns at once; never raises into training

Importing this package imports neither torch nor zmq: `start()` does.
"""

from .api import data, mark, phase, step
from .core import VERSION, current, start, stop

__all__ = ["start", "stop", "step", "phase", "mark", "data", "current", "VERSION"]
