"""Every `import torchtop...` and `from torchtop... import name` in the tree resolves, the ones
inside functions too: pyright checks only the strict layers, and a rename once left lazy imports
(`from torchtop.contract import keys` in the relay's code) that failed only when a job's report
reached them."""

from __future__ import annotations

import ast
import importlib
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# the extras' packages (pyproject's optional-dependencies) and the names they import under
OPTIONAL = (
    "torch",
    "textual",
    "textual_plotext",
    "prometheus_client",
    "opentelemetry",
    "lightning",
    "pytorch_lightning",
    "transformers",
    "accelerate",
)


def _sources() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / name for name in out.stdout.split()]


def _imports(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, module, name or None) of each absolute torchtop import in `path`."""
    found: list[tuple[int, str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").startswith("torchtop")
        ):
            found += [(node.lineno, str(node.module), a.name) for a in node.names if a.name != "*"]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, None) for a in node.names if a.name.startswith("torchtop")]
    return found


def _resolves(module: str, name: str | None) -> str:
    """ "" when `from module import name` (or `import module`) works here, else why not."""
    try:
        mod = importlib.import_module(module)
        if name is None or hasattr(mod, name):
            return ""
        importlib.import_module(f"{module}.{name}")
        return ""
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] in OPTIONAL:
            return ""  # an optional extra not installed here: its own tests skip
        return f"{type(exc).__name__}: {exc}"
    except ImportError as exc:
        return f"{type(exc).__name__}: {exc}"


def test_every_torchtop_import_in_the_tree_resolves() -> None:
    pytest.importorskip("torch")
    broken = []
    seen: dict[tuple[str, str | None], str] = {}
    for path in _sources():
        for line, module, name in _imports(path):
            key = (module, name)
            if key not in seen:
                seen[key] = _resolves(module, name)
            if seen[key]:
                broken.append(f"{path.relative_to(ROOT)}:{line}: {module} {name or ''}: {seen[key]}")
    assert len(seen) > 100, len(seen)  # the walk found the tree's imports
    assert not broken, "\n".join(broken)
