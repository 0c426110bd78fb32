"""Every broad exception handler in agent/, monitor/ and demos/ says why it is broad: its `except`
line, or a comment line right above it, holds `# broad: <why>` (CONTRIBUTING.md, Lint and format)."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FOLDERS = ("agent", "monitor", "demos")
BROAD = {"Exception", "BaseException"}
MARK = "broad:"


def _caught(node: ast.expr | None) -> set[str]:
    """The names an `except` clause catches ("" for a bare `except:`)."""
    if node is None:
        return {""}
    if isinstance(node, ast.Tuple):
        return set().union(*(_caught(e) for e in node.elts))
    if isinstance(node, ast.Name):
        return {node.id}
    if isinstance(node, ast.Attribute):
        return {node.attr}
    return set()


def _comments(source: str) -> dict[int, str]:
    """Each line's comment text, from the tokenizer (a `#` inside a string is no comment)."""
    return {
        tok.start[0]: tok.string
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    }


def unexplained(source: str) -> list[tuple[int, str]]:
    """(line, why it fails) for each broad handler of `source` that does not say why it is broad."""
    lines = source.splitlines()
    comments = _comments(source)
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ExceptHandler):
            continue
        caught = _caught(node.type)
        if "" in caught:
            found.append((node.lineno, "a bare `except:`: write `except Exception:` (or BaseException)"))
            continue
        if not caught & BROAD:
            continue
        above = node.lineno - 1
        said = [comments.get(node.lineno, "")]
        if above >= 1 and lines[above - 1].lstrip().startswith("#"):
            said.append(comments.get(above, ""))
        if not any(MARK in c and c.split(MARK, 1)[1].strip() for c in said):
            found.append((node.lineno, f"`{lines[node.lineno - 1].strip()}` without `# {MARK} <why>`"))
    return sorted(found)


def test_every_broad_handler_says_why_it_is_broad() -> None:
    missing = [
        f"{path.relative_to(REPO)}:{line}: {why}"
        for folder in FOLDERS
        for path in sorted((REPO / folder).rglob("*.py"))
        for line, why in unexplained(path.read_text(encoding="utf-8"))
    ]
    assert not missing, "\n".join(missing)


def test_the_check_reads_the_except_line_and_the_comment_line_above() -> None:
    source = (
        "try:\n    pass\nexcept Exception:  # broad: said here\n    pass\n"
        "try:\n    pass\n# broad: said above\nexcept BaseException:\n    raise\n"
        "try:\n    pass\nexcept (ValueError, Exception):\n    pass\n"
        "try:\n    pass\nexcept Exception:  # no marker\n    pass\n"
        "try:\n    pass\nexcept Exception:  # broad:\n    pass\n"
        "try:\n    pass\nexcept:  # broad: bare\n    pass\n"
        "try:\n    pass\nexcept ValueError:\n    pass\n"
        's = "# broad: in a string"\ntry:\n    pass\nexcept Exception:\n    pass\n'
    )
    assert [line for line, _ in unexplained(source)] == [12, 16, 20, 24, 33]
