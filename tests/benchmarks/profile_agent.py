"""Where the agent's threads spend their CPU while a monitor listens: cProfile around each agent
loop tick and each slow-sampler pass, on the benchmark's launch-bound loop (CUDA) or CPU loop.

    python tests/benchmarks/profile_agent.py [--device cuda|cpu] [--seconds S] [--top N]

A diagnostic: prints the top functions by own time for each thread's work, and the CPU time a
step they cost. Not collected by pytest.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attached import Monitor  # noqa: E402
from bench_paired import _loop  # noqa: E402

import torchtop.agent as ta  # noqa: E402


def profiled(obj: Any, name: str, prof: cProfile.Profile) -> None:
    """`obj.name` run under `prof` (each call enables and disables it)."""
    orig = getattr(obj, name)

    def run(*args: Any, **kwargs: Any) -> Any:
        prof.enable()
        try:
            return orig(*args, **kwargs)
        finally:
            prof.disable()

    setattr(obj, name, run)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument(
        "--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    os.environ.setdefault("TORCHTOP_QUIET", "1")
    os.environ.setdefault("TORCHTOP_RUNTIME_DIR", tempfile.mkdtemp(prefix="torchtop-prof-"))
    if args.device == "cpu":
        torch.set_num_threads(1)
    step, _model, _opt, desc = _loop(args.device, 6 if args.device == "cuda" else 192)
    agent = ta.start()
    assert agent is not None
    loop_prof, slow_prof = cProfile.Profile(), cProfile.Profile()
    profiled(agent.loop, "_tick", loop_prof)
    if agent.telemetry is not None:
        profiled(agent.telemetry, "slow", slow_prof)
    listener = Monitor(os.getpid()).start()
    first = agent.probe.steps
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        step()
    steps = agent.probe.steps - first
    got = listener.finish(steps)
    print(f"{desc}: {steps} steps in {args.seconds:.0f} s; the monitor received {got.steps}")
    for name, prof in (("agent loop ticks", loop_prof), ("slow samplers", slow_prof)):
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        total = stats.total_tt  # type: ignore[attr-defined]
        print(f"== {name}: {total * 1e3:.1f} ms over the run = {total * 1e6 / max(1, steps):.2f} us a step")
        stats.sort_stats("tottime").print_stats(args.top)
        print("\n".join(out.getvalue().splitlines()[6:]))
    ta.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
