"""A quiet start: one line per job (rank 0's: where to attach), the rest behind TORCHTOP_VERBOSE=1,
no warning of torch's that torchtop's own calls trigger; problems still said."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from torchtop.agent.hooks.probe import Probe
from torchtop.agent.hooks.sync_window import PROTOTYPE_MESSAGE, SyncWindow
from torchtop.agent.warn import announce, notice, warn

torch = pytest.importorskip("torch")


def test_by_default_only_rank_0_says_where_to_attach_and_nothing_else(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("TORCHTOP_QUIET")
    monkeypatch.delenv("TORCHTOP_VERBOSE", raising=False)
    announce("where to attach", rank=0)
    announce("where to attach", rank=3)
    notice("counting the model's FLOPs")
    warn("cannot write the discovery file")
    assert capsys.readouterr().err.splitlines() == [
        "torchtop: where to attach",
        "torchtop: cannot write the discovery file",
    ]


def test_verbose_says_it_all_and_quiet_only_problems(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("TORCHTOP_QUIET")
    monkeypatch.setenv("TORCHTOP_VERBOSE", "1")
    announce("rank 3 listens", rank=3)
    notice("counting the model's FLOPs")
    assert len(capsys.readouterr().err.splitlines()) == 2
    monkeypatch.setenv("TORCHTOP_QUIET", "1")
    announce("rank 0 listens", rank=0)
    notice("counting the model's FLOPs")
    warn("a problem")
    assert capsys.readouterr().err.splitlines() == ["torchtop: a problem"]
    monkeypatch.setenv("TORCHTOP_VERBOSE", "0")  # "0" is off, not a value that turns it on
    monkeypatch.delenv("TORCHTOP_QUIET")
    notice("counting the model's FLOPs")
    assert capsys.readouterr().err == ""


class PrototypeCuda:
    """torch.cuda's sync debug mode, with the warning torch raises at its first use."""

    def __init__(self) -> None:
        self.mode = 0

    def get_sync_debug_mode(self) -> int:
        return self.mode

    def set_sync_debug_mode(self, mode: int) -> None:
        warnings.warn(
            PROTOTYPE_MESSAGE + " and does not yet detect all synchronizing operations",
            UserWarning,
            stacklevel=2,
        )
        self.mode = mode


def test_the_sync_check_keeps_torchs_prototype_warning_to_itself() -> None:
    shown: list[str] = []
    old, before = warnings.showwarning, list(warnings.filters)
    warnings.showwarning = lambda m, *a, **k: shown.append(str(m))  # type: ignore[assignment]
    try:
        w = SyncWindow(SimpleNamespace(cuda=PrototypeCuda()), Probe(threading.get_ident()), None, {})  # type: ignore[arg-type]
        assert w.open()
        w.close()
        assert warnings.filters == before  # the filter went with the call
        warnings.warn(PROTOTYPE_MESSAGE + " (the user's own call)", UserWarning, stacklevel=1)
    finally:
        warnings.showwarning = old
    assert shown == [PROTOTYPE_MESSAGE + " (the user's own call)"]


DDP_SCRIPT = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    import torchtop.agent
    torchtop.agent.start()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(120):  # past the FLOP count (step 20) and a few agent ticks
        loss = model(torch.randn(16, 32)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.barrier()
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_a_4_rank_job_prints_one_torchtop_line_and_no_warning_of_ours(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(DDP_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHTOP_QUIET", "TORCHTOP_VERBOSE")}
    env["PYTHONWARNINGS"] = "default"  # every warning shows, once per place
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", str(script)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    ours = [line for line in out.stderr.splitlines() if line.startswith("torchtop:")]
    assert len(ours) == 1, out.stderr
    assert "4 ranks" in ours[0] and "torchtop attach" in ours[0]
    warned = [line for line in out.stderr.splitlines() if "Warning:" in line and "NumPy" not in line]
    assert warned == [], out.stderr  # (NumPy: this torch build's own, at import, without numpy installed)
