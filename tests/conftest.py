"""Shared fixtures: every test gets its own runtime directory and no agent outlives its test.

torch is imported lazily (only to decide whether a `cuda` test can run), so monitor-only tests
collect and run without paying for it.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

# A suite started as a background job of a non-interactive shell (`.ci/run &`) has SIGINT ignored,
# and every process a test starts inherits that across exec: a test's Ctrl-C would reach nothing.
# A Python handler is not inherited: the processes the tests start get the default again.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# One intra-op thread in this process and every job the tests start (torchrun already sets it for
# its ranks): the jobs share a small machine with the other worker, and OpenMP threads that
# spin-wait for a busy core cost CPU time and assert nothing. A user's own setting is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: three workers on two cores or more, one on one. With two on two cores, a quarter
    of the machine's time went idle (measured): tests waiting on a terminal, a socket or a job's
    sleep hold a worker while using no CPU, and a third worker fills that time. More would crowd
    the multi-process jobs the slow tests start (two to sixteen processes each) on a big machine
    too, and the tests assert shares of a step, not speed. The fast subset (`-m "not slow"`) is
    in-process CPU work that never waits: two there (a third made it 57 s against 41-49)."""
    cores = len(os.sched_getaffinity(0))
    if "not slow" in (config.getoption("markexpr", "") or ""):
        return max(1, min(2, cores))
    return 3 if cores >= 2 else 1


def _cuda_available() -> bool:
    try:
        import torch
    except Exception:
        return False
    try:
        return bool(torch.cuda.is_available())
    except Exception:
        return False


# an extra's marker -> the modules its tests import; the README's test line runs without the
# extras (they skip, with this reason), and .ci/run runs these markers again once it installs them
EXTRAS = {
    "integrations": ("lightning", "transformers", "accelerate"),
    "export": ("prometheus_client", "opentelemetry.sdk"),
}


def _missing(modules: tuple[str, ...]) -> list[str]:
    from importlib.util import find_spec

    out = []
    for name in modules:
        try:
            found = find_spec(name) is not None
        except (ImportError, ValueError):  # a parent package missing
            found = False
        if not found:
            out.append(name)
    return out


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("cuda") is not None and not _cuda_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
    for extra, modules in EXTRAS.items():
        if item.get_closest_marker(extra) is not None and len(_missing(modules)) == len(modules):
            pytest.skip(
                f"needs the [{extra}] extra (pip install -e '.[{extra}]'): none of {', '.join(modules)}"
            )
    if item.get_closest_marker("tmux") is not None and shutil.which("tmux") is None:
        pytest.skip("needs tmux (not on PATH)")


@pytest.fixture(autouse=True)
def _isolated_agent(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
):
    """A private runtime dir and a quiet agent per test; any in-process agent stopped afterwards.

    The runtime directory is outside `tmp_path`, so tests that list `tmp_path` see only their own
    files. Child processes inherit all of this through os.environ.
    """
    runtime = tmp_path_factory.mktemp("rt")
    monkeypatch.setenv("TORCHTOP_RUNTIME_DIR", str(runtime))
    monkeypatch.setenv("TORCHTOP_QUIET", "1")
    # the developer's own keys, ports, autostart and launcher variables stay out of the tests
    monkeypatch.setenv("TORCHTOP_CONFIG_DIR", str(tmp_path_factory.mktemp("cfg")))
    for name in (
        "TORCHTOP",
        "TORCHTOP_PORT",
        "TORCHTOP_BIND",
        "TORCHTOP_SERVER_KEY",
        "TORCHTOP_AUTHORIZED_KEYS",
        "TORCHTOP_CURVE",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "TORCHTOP_PHASE_EVERY",
    ):
        monkeypatch.delenv(name, raising=False)
    # Tests of the step model check every step's phases: they time every step. Phase sampling
    # (the default on steps under 10 ms) runs in the tests marked `phase_sampling`: its own
    # tests and the end-to-end ones (scenarios, demo, `torchtop run`, tmux).
    if request.node.get_closest_marker("phase_sampling") is None:
        monkeypatch.setenv("TORCHTOP_PHASE_EVERY", "1")
    yield runtime
    if "torchtop.agent" in sys.modules:
        import torchtop.agent

        torchtop.agent.stop()


@pytest.fixture
def runtime_dir(_isolated_agent: Path) -> Path:
    """This test's TORCHTOP_RUNTIME_DIR."""
    return _isolated_agent


@pytest.fixture
def subprocess_env() -> dict[str, str]:
    """The environment for a child process: this test's runtime dir, unbuffered output."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture(scope="module")
def one_thread_warm_torch():
    """One intra-op thread (the 2-core machines are shared) and torch's lazy imports done.

    For the modules that train real CPU loops: `pytestmark = pytest.mark.usefixtures(...)`.
    """
    import torch

    from tests.agent_util import mlp, tensor_loader, train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    train(mlp(), tensor_loader(2))
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def agent():
    """An in-process agent started for this test, stopped afterwards (some modules have their own)."""
    import torchtop.agent as ta

    a = ta.start()
    assert a is not None
    yield a
    ta.stop()


@pytest.fixture
def group():  # type: ignore[no-untyped-def]
    """A one-rank gloo process group (a real one; world size 1): a collective, a pipeline stage
    that is first and last, with no peer."""
    import torch.distributed as dist

    from tests.agent_util import free_port

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
