"""Checkpoints timed on a real GPU (issue 38, item 2): a DCP async save every N steps, and a plain
`torch.save` every N steps, each against the time the script measures around its own calls.

    python tests/gpu/checkpoint_check.py [--every 10] [--steps 300] [--mode async|save]

A bf16 MLP on cuda:0 under the agent, recorded. `async`: `dcp.async_save` every `every` steps (its
staging on the training thread), the previous save's `.result()` waited before the next; `save`:
`torch.save` of the state dict. The recording's report over the run must give the `checkpoint`
phase a share within 5 points of the truth (the script's own timing of the save calls over the
run's wall time) and, past 10%, the `checkpoint` verdict. Prints both; exit 0 when they agree.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torchtop.agent as ta  # noqa: E402
from torchtop.monitor.diagnosis.report import run_report  # noqa: E402
from torchtop.monitor.model.playback import load  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--mode", choices=("async", "save"), default="async")
    args = p.parse_args()
    import importlib

    dcp: Any = importlib.import_module("torch.distributed.checkpoint")  # async_save: not in its stubs

    out = Path(tempfile.mkdtemp(prefix="ckpt-rec-"))
    ckpt = Path(tempfile.mkdtemp(prefix="ckpt-"))
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, dtype=torch.bfloat16) for _ in range(8)]).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    x = torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16)
    agent = ta.start(record=out)
    if agent is None:
        print("the agent did not start")
        return 1
    for _ in range(15):  # warm-up: past the verdict's first 10 steps
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()
    torch.cuda.synchronize()
    time.sleep(1.0)
    saving = 0.0
    pending: Any = None
    t0 = time.time()
    for i in range(args.steps):
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()
        if i % args.every == args.every - 1:
            s = time.perf_counter()
            if args.mode == "async":
                if pending is not None:
                    pending.result()
                pending = dcp.async_save(model.state_dict(), checkpoint_id=str(ckpt / f"step{i}"))
            else:
                torch.save(model.state_dict(), ckpt / f"step{i}.pt")
            saving += time.perf_counter() - s
        torch.cuda.synchronize()
    if pending is not None:
        pending.result()
    t1 = time.time()
    time.sleep(1.5)
    agent.stop()
    truth = saving / (t1 - t0)
    playback, _ = load(out)
    state = playback.state_until(None)
    window = state.agent_time - t0 + 1e-3
    r = run_report(state, window, window=window)
    # the verdict's share: every judged step's saves (the breakdown's is the phase-timed steps')
    share = r.verdict.share if r.verdict.kind == "checkpoint" else r.breakdown.get("checkpoint", 0.0)
    print(f"{args.mode} every {args.every} steps: {saving:.2f} s of saving in {t1 - t0:.2f} s ({truth:.1%})")
    print(
        f"torchtop: checkpoint {share:.1%} of wall time (breakdown {r.breakdown.get('checkpoint', 0.0):.1%}); verdict {r.verdict.kind}: {r.verdict.evidence[:2]}"
    )
    ok = abs(share - truth) <= 0.05 and (truth < 0.12 or r.verdict.kind == "checkpoint")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
