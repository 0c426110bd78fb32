"""A tiny CPU training loop with the agent, in a child process, for the security and SSH tests."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torchtop.agent.contract import discovery

TRAIN = r"""
import sys, time, torch
import torchtop.agent

torch.set_num_threads(1)
torchtop.agent.start()
model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x, y = torch.randn(64, 128), torch.randn(64, 1)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
"""


@contextmanager
def training_agent(
    tmp_path: Path, env: dict[str, str], seconds: float = 120.0
) -> Iterator[tuple[subprocess.Popen[bytes], dict[str, Any]]]:
    """Start the loop (agent inside) and yield (process, its discovery entry); kill it afterwards."""
    script = tmp_path / "train_tiny.py"
    script.write_text(TRAIN)
    log = (tmp_path / "train.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, str(script), str(seconds)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 60
        info = None
        while info is None and time.monotonic() < deadline and proc.poll() is None:
            info = next((a for a in discovery.list_agents() if a.get("pid") == proc.pid), None)
            time.sleep(0.05)
        if info is None:
            log.flush()
            raise AssertionError(
                f"the training agent did not start: {(tmp_path / 'train.log').read_text()[-2000:]}"
            )
        yield proc, info
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
