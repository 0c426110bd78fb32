"""Training-thread code imports only what it runs: the hooks never load the stack sampler's
module (frame classification lives in agent/hooks/frames.py), nor any other package of the
agent's own threads (telemetry, the agent loop, captures): those register step-boundary hooks
with the probe (agent/hooks/step_hooks.py), the hooks never reach for them."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

AGENT_THREADS = ("torchtop.agent.telemetry", "torchtop.agent.loop", "torchtop.agent.capture")


@pytest.mark.slow  # a fresh interpreter that imports torch
def test_hooks_do_not_load_the_stack_sampler() -> None:
    code = (
        "import sys, pkgutil, importlib, torchtop.agent.hooks as h\n"
        "for m in pkgutil.iter_modules(h.__path__):\n"
        "    importlib.import_module('torchtop.agent.hooks.' + m.name)\n"
        "print(sorted(k for k in sys.modules if k.startswith('torchtop.agent.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "torchtop.agent.telemetry.stacks" not in out.stdout, out.stdout
    loaded = [m for m in ast.literal_eval(out.stdout) if m.startswith(AGENT_THREADS)]
    assert not loaded, f"training-thread modules load the agent threads' modules: {loaded}"
    assert "torchtop.agent.hooks.step_hooks" in out.stdout  # the walk did import every hooks module
