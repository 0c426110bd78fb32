"""The maps cannot go stale: CONTRIBUTING's layout names every module of agent/ and monitor/ in its
folder (and no module that is gone), and docs/architecture.md names every thread the agent starts."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIDES = ("agent", "monitor")


def layout_modules(text: str) -> set[str]:
    """Module paths the layout block names: a line whose first word ends in "/" opens a folder
    (nested by indentation); every `name.py` on a line belongs to the folder open at its indent."""
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    stack: list[tuple[int, str]] = []
    named: set[str] = set()
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        first = line.split()[0]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if first.endswith("/"):
            stack.append((indent, (stack[-1][1] if stack else "") + first))
        folder = stack[-1][1] if stack else ""
        for name in re.findall(r"\b([a-z_][a-z0-9_]*\.py)\b", line):
            named.add(folder + name)
    return named


def tree_modules() -> set[str]:
    return {
        p.relative_to(ROOT).as_posix()
        for side in SIDES
        for p in (ROOT / side).rglob("*.py")
        if p.name != "__init__.py" and "__pycache__" not in p.parts
    }


def test_layout_names_every_module() -> None:
    named = {m for m in layout_modules((ROOT / "CONTRIBUTING.md").read_text()) if m.startswith(SIDES)}
    tree = tree_modules()
    missing, gone = sorted(tree - named), sorted(named - tree)
    assert not missing, f"CONTRIBUTING.md's layout does not name (add each in its folder's lines): {missing}"
    assert not gone, f"CONTRIBUTING.md's layout names modules that are gone: {gone}"


def test_layout_parser_places_names_in_their_folder() -> None:
    text = "## Layout\n```\nagent/   x\n  hooks/  a.py,\n          b.py\n  core.py c.py\nmonitor/\n```\n"
    assert layout_modules(text) == {"agent/hooks/a.py", "agent/hooks/b.py", "agent/core.py", "agent/c.py"}


def agent_threads() -> set[str]:
    """The names of the threads the agent starts (threading.Thread(name=...) and subclasses')."""
    names = set()
    for p in (ROOT / "agent").rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Call):
                for kw in node.keywords:
                    if (
                        kw.arg == "name"
                        and isinstance(kw.value, ast.Constant)
                        and str(kw.value.value).startswith("torchtop-")
                    ):
                        names.add(kw.value.value)
    return names


def test_architecture_lists_every_agent_thread() -> None:
    threads = agent_threads()
    assert {"torchtop-agent", "torchtop-sampler", "torchtop-stacks"} <= threads  # the scan finds them
    doc = (ROOT / "docs" / "architecture.md").read_text()
    table = doc.split("## Which thread runs which folder", 1)[1].split("\n## ", 1)[0]
    missing = sorted(t for t in threads if f"`{t}`" not in table)
    assert not missing, f"docs/architecture.md's thread table lacks {missing}"
    count = len(threads) + 1  # the training thread and the agent's own
    words = {4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine"}
    assert f"{words.get(count, count)} threads" in table, (
        f"docs/architecture.md: say the agent runs in {count} threads"
    )
