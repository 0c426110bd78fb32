"""Import boundaries (CONTRIBUTING.md), each checked in a fresh interpreter over whole folders.

- the monitor never imports torch, and no monitor module loads the agent's machinery
  (`torchtop.agent.core`, which registers atexit and at-fork handlers);
- the agent never imports textual; importing `torchtop.agent` imports nothing else;
- the contract (`torchtop.contract`) imports only msgspec and the standard library;
- the monitor's pure layers (model, diagnosis) import neither textual, zmq nor torch; its link
  to agents imports neither textual nor torch; its export layer neither textual, zmq nor torch,
  and its exporters' libraries (prometheus_client, opentelemetry: the `export` extra) only when used;
- no module of either side takes part in an import circle.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.extras import missing_integrations

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"agent": "torchtop.agent", "monitor": "torchtop.monitor", "demos": "torchtop.demos"}

WALK = """
import importlib, pkgutil, sys
def walk(name, skip=()):
    pkg = importlib.import_module(name)
    names = [name]
    if not hasattr(pkg, "__path__"):
        return names
    for info in pkgutil.walk_packages(pkg.__path__, name + "."):
        if any(info.name == s or info.name.startswith(s + ".") for s in skip):
            continue
        importlib.import_module(info.name)
        names.append(info.name)
    return names
"""


def run_fresh(body: str) -> dict:
    """Run `body` in a fresh interpreter; it must print one JSON object as its last line."""
    code = WALK + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def loaded(*names: str) -> str:
    return "{" + ", ".join(f"{n!r}: {n!r} in sys.modules" for n in names) + "}"


def _textual_missing() -> bool:
    try:
        import textual  # noqa: F401
    except ImportError:
        return True
    return False


def test_monitor_never_imports_torch_nor_the_agents_machinery() -> None:
    skip = "('torchtop.monitor.tui',)" if _textual_missing() else "()"
    out = run_fresh(
        f"""
        import json
        names = walk("torchtop.monitor", skip={skip})
        agent = sorted(m for m in sys.modules if m.startswith("torchtop.agent"))
        print(json.dumps({{"modules": names, "agent": agent, "loaded": {loaded("torch")}}}))
        """
    )
    assert (
        "torchtop.monitor.commands.cli" in out["modules"] and "torchtop.monitor.link.client" in out["modules"]
    )
    assert out["loaded"] == {"torch": False}, f"a monitor module imported torch: {out['modules']}"
    # the monitor reaches into the agent's package for the contract and nothing else
    outside = [
        m
        for m in out["agent"]
        if m not in ("torchtop.agent", "torchtop.contract") and not m.startswith("torchtop.contract.")
    ]
    assert outside == [], f"monitor modules loaded the agent's machinery: {outside}"


@pytest.mark.parametrize("layer", ["model", "diagnosis"])
def test_monitor_pure_layers(layer: str) -> None:
    out = run_fresh(
        f"""
        import json
        names = walk("torchtop.monitor.{layer}")
        print(json.dumps({{"modules": names, "loaded": {loaded("torch", "zmq", "textual")}}}))
        """
    )
    assert len(out["modules"]) > 2
    assert out["loaded"] == {"torch": False, "zmq": False, "textual": False}, out["modules"]


def test_monitor_export_layer_is_pure_and_loads_its_libraries_on_use() -> None:
    out = run_fresh(
        f"""
        import json
        names = walk("torchtop.monitor.export")
        print(json.dumps({{"modules": names, "loaded": {loaded("torch", "zmq", "textual", "prometheus_client", "opentelemetry")}}}))
        """
    )
    assert (
        "torchtop.monitor.export.perfetto" in out["modules"]
        and "torchtop.monitor.export.otlp" in out["modules"]
    )
    assert not any(out["loaded"].values()), out["loaded"]


def test_monitor_link_needs_no_tui() -> None:
    out = run_fresh(
        f"""
        import json
        names = walk("torchtop.monitor.link")
        print(json.dumps({{"modules": names, "loaded": {loaded("torch", "textual")}}}))
        """
    )
    assert "torchtop.monitor.link.ssh" in out["modules"]
    assert out["loaded"] == {"torch": False, "textual": False}


def test_agent_never_imports_textual() -> None:
    missing = missing_integrations()  # an integration whose framework is not installed: left out
    out = run_fresh(
        f"""
        import json
        names = walk("torchtop.agent", skip={missing!r})
        print(json.dumps({{"modules": names, "loaded": {loaded("textual")}}}))
        """
    )
    on_disk = {_dotted(p) for p in (ROOT / "agent").rglob("*.py") if "_boot" not in p.parts} - set(missing)
    assert on_disk <= set(out["modules"]), f"not walked: {on_disk - set(out['modules'])}"
    assert out["loaded"] == {"textual": False}


def test_agent_package_import_is_light() -> None:
    out = run_fresh(
        f"""
        import json
        import torchtop.agent
        result = {loaded("torch", "zmq", "textual", "torchtop.agent.core")}
        assert callable(torchtop.agent.start) and callable(torchtop.agent.stop)
        print(json.dumps(result))
        """
    )
    assert out == {"torch": False, "zmq": False, "textual": False, "torchtop.agent.core": False}


def test_contract_imports_only_msgspec_and_starts_nothing() -> None:
    out = run_fresh(
        f"""
        import atexit, json, os
        registered = []
        atexit.register = lambda *a, **k: registered.append(a)  # nothing of the agent may register
        names = walk("torchtop.contract")
        agent = sorted(m for m in sys.modules if m.startswith("torchtop.agent"))
        result = {loaded("torch", "zmq", "textual", "msgspec")}
        result["agent"] = agent
        result["atexit"] = len(registered)
        print(json.dumps(result))
        """
    )
    assert {k: out[k] for k in ("torch", "zmq", "textual", "msgspec")} == {
        "torch": False,
        "zmq": False,
        "textual": False,
        "msgspec": True,
    }
    assert all(m == "torchtop.agent" or m.startswith("torchtop.contract") for m in out["agent"]), out["agent"]
    assert out["atexit"] == 0


@pytest.mark.slow  # imports torch in a fresh interpreter
def test_agent_start_imports_torch_and_zmq() -> None:
    """The other half of the boundary: start() is what pays for torch and zmq."""
    out = run_fresh(
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


# -- import circles ------------------------------------------------------------------------------
def _dotted(path: Path) -> str:
    rel = path.relative_to(ROOT)
    parts = [PACKAGES[rel.parts[0]], *rel.parts[1:-1]]
    if rel.stem != "__init__":
        parts.append(rel.stem)
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The torchtop modules `path` imports at run time, at any depth (TYPE_CHECKING ones aside)."""
    me = _dotted(path)
    package = me if path.stem == "__init__" else me.rsplit(".", 1)[0]
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                out.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                out.add(base)
                out.update(f"{base}.{a.name}" for a in child.names)
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return {m for m in out if m in modules and m != me}


def test_no_import_circles() -> None:
    files = [p for d in PACKAGES for p in (ROOT / d).rglob("*.py") if "_boot" not in p.parts]
    modules = {_dotted(p) for p in files}
    graph = {_dotted(p): _imports(p, modules) for p in files}
    for name in list(graph):  # a package's __init__ is not imported through its modules here
        graph[name] = {m for m in graph[name] if not name.startswith(m + ".")}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def strong(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    assert circles == [], f"import circles: {circles}"
