"""Import boundaries (DEVELOPERS.md), each checked in a fresh interpreter.

- the monitor never imports torch;
- the agent never imports textual; importing `torchtop.agent` imports neither torch nor zmq
  (`start()` does);
- the wire schema imports neither torch, zmq nor textual;
- the monitor's pure modules (state, replay, report, diagnosis and their helpers) import neither textual,
  zmq nor torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

WALK = """
import importlib, pkgutil, sys
def walk(name, skip=()):
    pkg = importlib.import_module(name)
    names = [name]
    for info in pkgutil.walk_packages(pkg.__path__, name + "."):
        if any(info.name == s or info.name.startswith(s + ".") for s in skip):
            continue
        importlib.import_module(info.name)
        names.append(info.name)
    return names
"""


def run_probe(body: str) -> dict:
    """Run `body` in a fresh interpreter; it must print one JSON object as its last line."""
    code = WALK + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def loaded(*names: str) -> str:
    return "{" + ", ".join(f"{n!r}: {n!r} in sys.modules" for n in names) + "}"


def test_monitor_never_imports_torch() -> None:
    try:
        import textual  # noqa: F401

        skip = "()"
    except ImportError:  # the TUI modules need textual; everything else must still import
        skip = "('torchtop.monitor.app', 'torchtop.monitor.widgets', 'torchtop.monitor.feed')"
    out = run_probe(
        f"""
        import json
        names = walk("torchtop.monitor", skip={skip})
        print(json.dumps({{"modules": names, "loaded": {loaded("torch")}}}))
        """
    )
    assert "torchtop.monitor.cli" in out["modules"]
    assert "torchtop.monitor.client" in out["modules"]
    assert out["loaded"] == {"torch": False}, f"a monitor module imported torch: {out['modules']}"


def test_agent_never_imports_textual() -> None:
    out = run_probe(
        f"""
        import json
        names = walk("torchtop.agent")
        print(json.dumps({{"modules": names, "loaded": {loaded("textual")}}}))
        """
    )
    for module in ("wire", "probe", "cuda_timing", "hooks", "hooks_h2d", "publisher", "sockets", "discovery", "core", "api"):
        assert f"torchtop.agent.{module}" in out["modules"]
    assert out["loaded"] == {"textual": False}


def test_agent_package_import_is_light() -> None:
    out = run_probe(
        f"""
        import json
        import torchtop.agent
        assert callable(torchtop.agent.start) and callable(torchtop.agent.stop)
        print(json.dumps({loaded("torch", "zmq", "textual")}))
        """
    )
    assert out == {"torch": False, "zmq": False, "textual": False}


def test_wire_imports_only_msgspec() -> None:
    out = run_probe(
        f"""
        import json
        import torchtop.agent.wire
        print(json.dumps({loaded("torch", "zmq", "textual", "msgspec")}))
        """
    )
    assert out == {"torch": False, "zmq": False, "textual": False, "msgspec": True}


@pytest.mark.parametrize("module", ["state", "replay", "log_replay", "report", "targets", "diagnosis", "diagnosis_flags", "judge", "fmt"])
def test_monitor_pure_modules(module: str) -> None:
    import importlib.util

    name = f"torchtop.monitor.{module}"
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} does not exist (yet)")
    out = run_probe(
        f"""
        import json
        import {name}
        print(json.dumps({loaded("torch", "zmq", "textual")}))
        """
    )
    assert out == {"torch": False, "zmq": False, "textual": False}


def test_agent_start_imports_torch_and_zmq() -> None:
    """The other half of the boundary: start() is what pays for torch and zmq."""
    out = run_probe(
        f"""
        import json, os
        os.environ["TORCHTOP_QUIET"] = "1"
        import torchtop.agent
        agent = torchtop.agent.start()
        result = {loaded("torch", "zmq", "textual")}
        result["started"] = agent is not None
        torchtop.agent.stop()
        print(json.dumps(result))
        """
    )
    assert out == {"torch": True, "zmq": True, "textual": False, "started": True}
