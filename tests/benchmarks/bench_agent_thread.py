"""CPU time the agent's own thread spends per training step, unattended and with a listener.

    python tests/benchmarks/bench_agent_thread.py [--hidden H] [--steps N] [--rounds R]

Its figures go in docs/benchmarks.md (a dated section per round).

Not collected by pytest. That thread shares the GIL with training: whatever Python it runs per
step, the training thread may wait for. It is timed with `time.thread_time_ns()` around each of
its ticks (its CPU time, not wall time, so other processes do not blur it), on the benchmark's
CPU loop, with nobody attached and then with the batch stream marked subscribed (the agent
publishes every chunk). Prints microseconds of agent-thread CPU per training step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

import torchtop.agent as ta

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_overhead import cpu_loop  # noqa: E402


def measure(step: Any, steps: int, attached: bool) -> tuple[float, float]:
    """(agent-thread CPU us per step, training step ms) over `steps` steps."""
    agent = ta.start()
    if agent is None:
        raise SystemExit("the agent did not start")
    try:
        for _ in range(100):
            step()
        spent = [0]
        orig = agent.loop._tick

        def tick() -> None:
            t = time.thread_time_ns()
            orig()
            spent[0] += time.thread_time_ns() - t

        agent.loop._tick = tick
        agent.loop.subscribed = attached
        time.sleep(0.25)
        spent[0] = 0
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        wall = time.perf_counter() - t0
        time.sleep(0.25)  # the ticks that drain the last steps
        return spent[0] / steps / 1000, wall / steps * 1000
    finally:
        ta.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    os.environ.setdefault("TORCHTOP_QUIET", "1")
    os.environ.setdefault("TORCHTOP_RUNTIME_DIR", tempfile.mkdtemp(prefix="torchtop-bench-"))
    torch.set_num_threads(1)
    step, _, desc = cpu_loop(args.hidden, 64)
    print(f"{desc}; {args.rounds} rounds x {args.steps} steps")
    for attached in (False, True):
        runs = [measure(step, args.steps, attached) for _ in range(args.rounds)]
        us = statistics.median(r[0] for r in runs)
        ms = statistics.median(r[1] for r in runs)
        label = "attached  " if attached else "unattended"
        print(
            f"{label}: agent thread {us:.2f} us CPU per step (runs: {', '.join(f'{r[0]:.2f}' for r in runs)}); "
            f"step {ms:.3f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
