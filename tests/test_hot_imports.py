"""Training-thread code imports only what it runs: the hooks never load the stack sampler's
module (frame classification lives in agent/hooks/frames.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.slow  # a fresh interpreter that imports torch
def test_hooks_do_not_load_the_stack_sampler() -> None:
    code = (
        "import sys, pkgutil, importlib, torchtop.agent.hooks as h\n"
        "for m in pkgutil.iter_modules(h.__path__):\n"
        "    importlib.import_module('torchtop.agent.hooks.' + m.name)\n"
        "print(sorted(k for k in sys.modules if k.startswith('torchtop.agent.telemetry')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "torchtop.agent.telemetry.stacks" not in out.stdout, out.stdout
