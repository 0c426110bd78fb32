"""NCCL DDP on two GPUs (the 2-GPU machine): tests/gpu/job_nccl.py under torchrun, both cases.

Skipped without two CUDA devices. The script prints the straggler verdict and, per rank, the
exposed collective wait per step from torchtop against torch.profiler; it exits 1 when the
verdict misses the slow rank or reason, or a waiting rank's mean differs by more than 10%.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cuda, pytest.mark.slow]
SCRIPT = Path(__file__).resolve().parent / "gpu" / "job_nccl.py"


@pytest.mark.parametrize("slow", ["data", "backward"])
def test_nccl_straggler_and_exposed_wait(slow: str, subprocess_env: dict[str, str]) -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(SCRIPT),
            "--slow",
            slow,
        ],
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    print(proc.stdout[-6000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
