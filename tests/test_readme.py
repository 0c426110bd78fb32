"""The README's set-up, as written: its two opening commands, what they install and run, and
`.ci/run` running the same test command.

The fast tests read the files; the slow one asks this machine's pip what the first command would
install (a dry run): where a CPU build of torch lies on local disk (the development VMs), that
build, not a multi-GB CUDA one from the index.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text(encoding="utf-8")
CI = (REPO / ".ci" / "run").read_text(encoding="utf-8")
VENV = "python3 -m venv .venv && . .venv/bin/activate && "


def opening() -> tuple[str, list[str]]:
    """(the prose before the first code block, that block's command lines)."""
    before, _, rest = README.partition("```bash\n")
    block = rest.partition("```")[0]
    return before, [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def pip_args(command: str) -> list[str]:
    """The arguments of the `pip install` in a `a && b && ...` command line."""
    part = next(p.strip() for p in command.split("&&") if re.match(r"\s*(python -m )?pip install ", p))
    return shlex.split(part)[2 if part.startswith("pip") else 4 :]


def test_the_readme_opens_with_two_commands_demo_then_tests() -> None:
    before, commands = opening()
    assert "##" not in before  # nothing but the title and prose before them
    assert len(commands) == 2, commands
    demo, tests = commands
    for command in commands:
        assert command.startswith(VENV), command  # the venv step, shown
    assert demo.endswith("&& torchtop demo")
    assert tests.endswith("&& python -m pytest -q")
    extras = re.search(r"\.\[([\w,]+)\]", demo)
    assert extras and "tui" in extras.group(1).split(",")  # the whole tool


def test_torch_is_pinned_and_the_cpu_way_is_told_before_the_commands() -> None:
    before, commands = opening()
    pins = [[a for a in pip_args(c) if a.startswith("torch")] for c in commands]
    assert pins[0] == pins[1] and len(pins[0]) == 1 and re.fullmatch(r"torch==[\d.]+", pins[0][0]), pins
    cpu = [line for line in before.splitlines() if "download.pytorch.org/whl/cpu" in line]
    assert len(cpu) == 1 and "No GPU" in cpu[0], before  # one line, before the commands


def test_the_python_versions_and_the_suite_time_are_stated() -> None:
    before, _ = opening()
    requires = re.search(r'requires-python = "([^"]+)"', (REPO / "pyproject.toml").read_text())
    assert requires
    low = requires.group(1)
    stated = re.search(r"Python (3\.\d+) to (3\.\d+)", before)
    assert stated and low == f">={stated.group(1)}", (low, before)
    assert re.search(r"takes\s+about \d+ minutes", README), "the README says how long the suite takes"


def test_ci_runs_the_readme_test_line_first_in_its_own_environment_then_the_extras() -> None:
    _, (_, tests) = opening()
    ci_lines = [line.strip() for line in CI.splitlines() if line.strip() and not line.startswith("#")]
    installs = [
        (k, pip_args(line)) for k, line in enumerate(ci_lines) if line.startswith("python -m pip install ")
    ]
    pytest_runs = [(k, line) for k, line in enumerate(ci_lines) if re.match(r"(python -m )?pytest\b", line)]
    # the README's install is the first, and the README's test line runs before any other install
    assert installs and installs[0][1] == pip_args(tests), (pip_args(tests), installs)
    first_run, readme_run = pytest_runs[0]
    assert readme_run == "python -m pytest -q" and tests.endswith(readme_run), pytest_runs
    assert all(k > first_run for k, _ in installs[1:]), "an install before the README's test line"
    # then the extras, and only their marked tests again
    extras = {e for _, args in installs[1:] for e in re.findall(r"\.\[(\w+)\]", " ".join(args))}
    assert extras == {"integrations", "export"}, extras
    assert [line for _, line in pytest_runs[1:]] == ['python -m pytest -q -m "integrations or export"']
    markers = (REPO / "pyproject.toml").read_text()
    assert all(f'"{e}: needs the [{e}] extra' in markers for e in extras)
    # the optional parts: CI installs each; the README names each as skipped without it
    for ci_says, readme_says in (
        ("'.[integrations]'", "'.[integrations]'"),
        ("tmux", "tmux"),
        ("sshd", "sshd"),
    ):
        assert ci_says in CI and readme_says in README.partition("## ")[0], readme_says


def _local_cpu_torch() -> bool:
    """Whether pip here finds a CPU build of torch on local disk (its find-links)."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60
    ).stdout
    dirs = re.findall(r"find-links='([^']*)'", out) + os.environ.get("PIP_FIND_LINKS", "").split()
    return any(Path(d).glob("torch-*+cpu-*.whl") for one in dirs for d in one.split() if Path(d).is_dir())


@pytest.mark.slow
def test_the_first_command_takes_the_local_cpu_torch_here(tmp_path: Path) -> None:
    if not _local_cpu_torch():
        pytest.skip("no CPU build of torch on local disk here (not a development VM)")
    _, (demo, _) = opening()
    report = tmp_path / "report.json"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--no-build-isolation",
            "--quiet",
            "--report",
            str(report),
            *pip_args(demo),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    chosen = {i["metadata"]["name"]: i for i in json.loads(report.read_text())["install"]}
    torch = chosen["torch"]
    assert torch["metadata"]["version"].endswith("+cpu"), torch["metadata"]["version"]
    assert torch["download_info"]["url"].startswith("file://"), torch["download_info"]["url"]
    assert not [name for name in chosen if name.startswith("nvidia-") and name != "nvidia-ml-py"]
    assert {"textual", "pyzmq", "msgspec"} <= set(chosen)
