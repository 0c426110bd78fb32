"""The wheel: built from a copy of this checkout, installed into a bare folder, imported from there.

Everything a user gets must come from the wheel, not from this checkout: the subprocess runs
outside the repository with only the installed folder on PYTHONPATH, and every module is
checked to load from it.
"""

from __future__ import annotations

import configparser
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.extras import missing_integrations

pytestmark = pytest.mark.slow  # builds and installs the wheel

REPO = Path(__file__).resolve().parent.parent
PACKAGES = {"agent": "torchtop.agent", "monitor": "torchtop.monitor", "demos": "torchtop.demos"}
SHIPPED = (".py", ".tcss")


def source_files() -> list[str]:
    """What a clone of this checkout would hold (tracked and new files, not ignored ones)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO,
            capture_output=True,
            check=True,
        ).stdout
        files = [f for f in out.decode().split("\0") if f]
        return [f for f in files if (REPO / f).is_file()]  # deleted but still in the index
    except (OSError, subprocess.CalledProcessError):  # not a git checkout
        skip = {".git", "__pycache__", "build", "dist", ".venv", ".hypothesis", ".pytest_cache"}
        return [
            str(p.relative_to(REPO))
            for p in REPO.rglob("*")
            if p.is_file() and not skip & set(p.relative_to(REPO).parts) and not p.name.endswith(".egg-info")
        ]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the wheel from a copy, so the checkout gets no build/ or egg-info of ours."""
    root = tmp_path_factory.mktemp("pkg")
    src = root / "src"
    for rel in source_files():
        if rel.startswith("tests/"):
            continue
        dst = src / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, dst)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(root / "dist"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    (whl,) = (root / "dist").glob("torchtop-*.whl")
    return whl


@pytest.fixture(scope="module")
def installed(wheel: Path) -> Path:
    target = wheel.parent.parent / "site"
    out = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return target


def isolated_env(target: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = str(target)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def test_wheel_holds_every_module_and_stylesheet(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        f"torchtop/{rel}"
        for rel in source_files()
        if rel.split("/", 1)[0] in PACKAGES and rel.endswith(SHIPPED) and "__pycache__" not in rel
    }
    assert {
        "torchtop/agent/contract/wire.py",
        "torchtop/monitor/commands/cli.py",
        "torchtop/monitor/tui/app.tcss",
    } <= expected
    missing = sorted(expected - names)
    assert not missing, f"in the checkout but not in the wheel: {missing}"
    assert not [n for n in names if n.startswith("tests/") or "/tests/" in n]
    assert not [n for n in names if n.endswith(".pyc")]


def test_wheel_metadata_and_entry_point(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        info = next(n.split("/")[0] for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        entry_points = zf.read(f"{info}/entry_points.txt").decode()
        metadata = zf.read(f"{info}/METADATA").decode()
    parser = configparser.ConfigParser()
    parser.read_string(entry_points)
    assert parser["console_scripts"]["torchtop"].strip() == "torchtop.monitor.commands.cli:main"
    requires = [
        line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")
    ]
    base = {
        r.split(">")[0].split("=")[0].split("<")[0].split(";")[0].strip().lower()
        for r in requires
        if "extra ==" not in r
    }
    assert {"textual", "pyzmq", "msgspec"} <= base
    assert "torch" not in base  # torch is an extra: the monitor runs without it
    extras = {
        line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Provides-Extra:")
    }
    assert {"torch", "dev"} <= extras


def test_installed_wheel_imports_from_its_folder(installed: Path, tmp_path: Path) -> None:
    code = (
        f"SKIP = {missing_integrations()!r}  # their frameworks are not installed here\n"
        + r"""
import importlib, importlib.resources, json, pkgutil
out = {}
for name in ("torchtop.agent", "torchtop.monitor", "torchtop.demos"):
    pkg = importlib.import_module(name)
    out[name] = [pkg.__file__] + [
        importlib.import_module(m.name).__file__
        for m in pkgutil.walk_packages(pkg.__path__, name + ".")
        if not m.name.split(".")[-1].startswith("_") and m.name not in SKIP
    ]
out["tcss"] = importlib.resources.files("torchtop.monitor.tui").joinpath("app.tcss").is_file()
import torchtop.agent
agent = torchtop.agent.start()
out["started"] = agent is not None
torchtop.agent.stop()
print(json.dumps(out))
"""
    )
    env = isolated_env(installed)
    env["TORCHTOP_QUIET"] = "1"
    env["TORCHTOP_RUNTIME_DIR"] = str(tmp_path / "rt")
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out.pop("tcss") is True
    assert out.pop("started") is True
    root = str(installed.resolve())
    for name, files in out.items():
        assert len(files) > 1, name
        outside = [f for f in files if not str(Path(f).resolve()).startswith(root)]
        assert not outside, f"{name} loaded from outside the installed wheel: {outside}"


def test_console_script_runs_from_the_wheel(installed: Path, tmp_path: Path) -> None:
    script = installed / "bin" / "torchtop"
    assert script.is_file()
    env = isolated_env(installed)
    env["TORCHTOP_RUNTIME_DIR"] = str(tmp_path / "rt")
    proc = subprocess.run(
        [str(script), "ls", "--json"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []
    proc = subprocess.run(
        [str(script), "report"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "no torchtop agent is running" in proc.stderr
