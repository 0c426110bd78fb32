"""Optional extras: which of the agent's integration modules can be imported on this machine.

An integration imports its framework at the top (lightning, transformers); where the framework
is not installed, tests that import every module leave that one out instead of failing.
"""

from __future__ import annotations

from importlib.util import find_spec

INTEGRATIONS = {
    "torchtop.agent.integrations.lightning": ("lightning", "pytorch_lightning"),
    "torchtop.agent.integrations.huggingface": ("transformers",),
}


def missing_integrations() -> tuple[str, ...]:
    """The integration modules whose framework is not installed (none of its import names)."""
    return tuple(
        module
        for module, frameworks in INTEGRATIONS.items()
        if not any(find_spec(name) is not None for name in frameworks)
    )
