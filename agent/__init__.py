"""torchtop's in-process agent: measures every training step, publishes it over ZeroMQ.

    import torchtop.agent
    torchtop.agent.start()     # returns at once; never raises into training

Importing this package loads nothing else and registers nothing: `start`, `step` and the rest
are loaded on first use, so `torchtop.contract` (what the monitor imports) stays free of
the agent's machinery. `start()` imports torch and zmq.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchtop.agent.core import current, start, stop
    from torchtop.agent.describe import VERSION
    from torchtop.agent.hooks.explicit import data, mark, phase, step

__all__ = ["start", "stop", "step", "phase", "mark", "data", "current", "VERSION"]
_WHERE = {
    "start": "torchtop.agent.core",
    "stop": "torchtop.agent.core",
    "current": "torchtop.agent.core",
    "VERSION": "torchtop.agent.describe",
    "step": "torchtop.agent.hooks.explicit",
    "phase": "torchtop.agent.hooks.explicit",
    "mark": "torchtop.agent.hooks.explicit",
    "data": "torchtop.agent.hooks.explicit",
}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'torchtop.agent' has no attribute {name!r}")
    value = getattr(import_module(where), name)
    globals()[name] = value  # once: later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
