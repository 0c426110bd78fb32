"""The wheel: built from a copy of this checkout, installed into a bare folder, imported from there.

Everything a user gets must come from the wheel, not from this checkout: the subprocess runs
outside the repository with only the installed folder on PYTHONPATH, and every module is
checked to load from it.
"""

from __future__ import annotations

import configparser
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.extras import missing_integrations

pytestmark = pytest.mark.slow  # builds and installs the wheel

REPO = Path(__file__).resolve().parent.parent
PACKAGES = {"agent": "torchtop.agent", "monitor": "torchtop.monitor", "demos": "torchtop.demos"}
SHIPPED = (".py", ".tcss")


def wheel_name(rel: str) -> str:
    """A checkout path's name in the wheel: the contract (agent/contract) installs as torchtop.contract."""
    return "torchtop/" + (rel.removeprefix("agent/") if rel.startswith("agent/contract/") else rel)


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
        wheel_name(rel)
        for rel in source_files()
        if rel.split("/", 1)[0] in PACKAGES and rel.endswith(SHIPPED) and "__pycache__" not in rel
    }
    assert {
        "torchtop/contract/wire.py",
        "torchtop/monitor/commands/cli.py",
        "torchtop/monitor/tui/app.tcss",
    } <= expected
    missing = sorted(expected - names)
    assert not missing, f"in the checkout but not in the wheel: {missing}"
    assert not [n for n in names if n.startswith("tests/") or "/tests/" in n]
    assert not [n for n in names if n.endswith(".pyc")]


def wheel_requirements(wheel: Path) -> tuple[dict[str, list[str]], set[str]]:
    """({extra or "": [distribution names]}, extras provided) from the wheel's METADATA."""
    with zipfile.ZipFile(wheel) as zf:
        info = next(n.split("/")[0] for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = zf.read(f"{info}/METADATA").decode()
    by_extra: dict[str, list[str]] = {}
    for line in metadata.splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1])
            extra = re.search(r"extra\s*==\s*[\"']([^\"']+)", str(req.marker or ""))
            by_extra.setdefault(extra.group(1) if extra else "", []).append(canonicalize_name(req.name))
    extras = {
        line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Provides-Extra:")
    }
    return by_extra, extras


def test_wheel_metadata_and_entry_point(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        info = next(n.split("/")[0] for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        entry_points = zf.read(f"{info}/entry_points.txt").decode()
    parser = configparser.ConfigParser()
    parser.read_string(entry_points)
    assert parser["console_scripts"]["torchtop"].strip() == "torchtop.monitor.commands.cli:main"
    requires, extras = wheel_requirements(wheel)
    # the core is the training side's: no TUI stack (a training image need not carry it), no torch
    assert sorted(requires[""]) == ["msgspec", "nvidia-ml-py", "psutil", "pyzmq"]
    assert {"textual", "textual-plotext", "rich"} <= set(requires["tui"])
    assert "torch" in requires["torch"]
    assert "torchtop" in requires["dev"]  # dev = tui + the test tools
    assert {"tui", "torch", "dev", "integrations"} <= extras


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


# -- the agent-only install: the core, without the TUI stack ---------------------------------------
TUI_STACK = ("textual", "rich", "textual_plotext", "plotext")

#: A training loop in the agent-only environment: it starts the agent and trains until killed.
AGENT_ONLY_TRAIN = """
import time, torch, torchtop.agent
assert torchtop.agent.start() is not None
model = torch.nn.Linear(16, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
while True:
    model(torch.randn(8, 16)).square().mean().backward()
    opt.step(); opt.zero_grad()
    time.sleep(0.005)
"""


def _closure(names: list[str]) -> list[importlib.metadata.Distribution]:
    """These installed distributions and everything they require (markers evaluated, no extras)."""
    seen: dict[str, importlib.metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        dist = importlib.metadata.distribution(name)
        seen[name] = dist
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def _link(dists: list[importlib.metadata.Distribution], into: Path) -> None:
    """Symlink each distribution's top-level files (packages, modules, its dist-info) into `into`."""
    into.mkdir(parents=True, exist_ok=True)
    for dist in dists:
        site = Path(str(dist.locate_file("")))  # a path-like; typeshed's SimplePath is no StrPath
        for top in {f.parts[0] for f in dist.files or [] if f.parts and f.parts[0] != ".."}:
            if not (into / top).exists() and (site / top).exists():
                (into / top).symlink_to(site / top)


@pytest.mark.slow
def test_agent_only_install_streams_without_the_tui_stack(wheel: Path, tmp_path: Path) -> None:
    """A venv holding the wheel and exactly its core requirements (plus torch, which the training
    script brings): the TUI stack is absent, the agent starts and streams steps that a headless
    `torchtop report` reads, and the TUI commands say in one line what to install."""
    requires, _ = wheel_requirements(wheel)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python, torchtop = venv / "bin" / "python", venv / "bin" / "torchtop"
    deps = tmp_path / "deps"  # the core's requirements and torch's, linked from this environment
    _link(_closure([*requires[""], "torch"]), deps)
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (site / "deps.pth").write_text(f"{deps}\n")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(TORCHTOP_RUNTIME_DIR=str(tmp_path / "rt"), TORCHTOP_QUIET="1")
    absent = subprocess.run(
        [
            str(python),
            "-c",
            f"import importlib.util as u; print([m for m in {TUI_STACK!r} if u.find_spec(m)])",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert absent.stdout.strip() == "[]", absent.stdout + absent.stderr

    script = tmp_path / "train.py"
    script.write_text(AGENT_ONLY_TRAIN)
    train = subprocess.Popen([str(python), str(script)], env=env, cwd=tmp_path)
    try:
        runtime = tmp_path / "rt"
        deadline = time.monotonic() + 90
        while not list(runtime.glob("*.json")):
            assert train.poll() is None, "the training script died"
            assert time.monotonic() < deadline, "no agent started"
            time.sleep(0.2)
        steps = 0
        while steps == 0 and time.monotonic() < deadline + 60:  # the first steps may come late
            report = subprocess.run(
                [str(torchtop), "report", str(train.pid), "--seconds", "2", "--history"],
                capture_output=True,
                text=True,
                env=env,
                cwd=tmp_path,
                timeout=120,
            )
            assert report.returncode == 0, report.stderr
            steps = json.loads(report.stdout)["steps"]
        assert steps > 0, report.stdout
        for command in (["attach", str(train.pid)], ["demo"], ["run", "--", "true"]):
            tui = subprocess.run(
                [str(torchtop), *command], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60
            )
            err = tui.stderr.strip()
            assert tui.returncode == 2 and "\n" not in err, (command, tui.stdout, err)
            assert "the TUI needs the full install: pip install 'torchtop[tui]'" in err, (command, err)
    finally:
        train.kill()
        train.wait(10)
