"""Where the agent's per-step cost lands: the CPU benchmark loop timed part by part (next batch,
forward, loss, zero_grad, backward, optimizer step), in five modes interleaved round by round.

    python tests/benchmarks/bench_parts.py [--hidden H] [--rounds R]

Its figures go in docs/benchmarks.md (a dated section per round).

Not collected by pytest. Modes: `off` (no agent), `threads` (`start(auto=False)`: the agent's
threads, no hook), `on` (`start()`), `on_noproc` (hooks on, the agent thread only empties the log:
what its replay and publishing cost), `on_nolog` (hooks in place, every entry thrown away: what the
hook layers cost by themselves). Each figure is the median over rounds of a block's lower-quartile
part time, as a difference from `off`, in microseconds.
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
from torch.utils.data import DataLoader, TensorDataset

import torchtop.agent as ta

PARTS = ("next", "fwd", "loss", "zero", "bwd", "step")
MODES = ("off", "threads", "on", "on_noproc", "on_nolog")


def loop(hidden: int) -> Any:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    crit = torch.nn.CrossEntropyLoss()
    loader = DataLoader(
        TensorDataset(torch.randn(8192, 256), torch.randint(0, 10, (8192,))), batch_size=64, shuffle=True
    )

    def batches() -> Any:
        while True:
            yield from loader

    it = batches()
    ns = time.perf_counter_ns

    def block(n: int) -> dict[str, float]:
        times: dict[str, list[int]] = {k: [] for k in (*PARTS, "total")}
        for _ in range(n):
            t0 = ns()
            x, y = next(it)
            t1 = ns()
            out = model(x)
            t2 = ns()
            loss = crit(out, y)
            t3 = ns()
            opt.zero_grad()
            t4 = ns()
            loss.backward()
            t5 = ns()
            opt.step()
            t6 = ns()
            for k, a, b in zip(PARTS, (t0, t1, t2, t3, t4, t5), (t1, t2, t3, t4, t5, t6)):
                times[k].append(b - a)
            times["total"].append(t6 - t0)
        return {k: statistics.quantiles(v, n=4)[0] / 1000 for k, v in times.items()}

    return block


def start(mode: str) -> Any:
    if mode == "off":
        return None
    agent = ta.start(auto=mode != "threads")
    if agent is None:
        raise SystemExit("the agent did not start")
    if mode == "on_noproc":
        setattr(agent.loop, "_tick", agent.probe.drain)  # noqa: B010  # a method swapped on the instance
    elif mode == "on_nolog":
        agent.probe.put = agent.probe._append = lambda entry: None
    return agent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=320)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args(argv)
    os.environ.setdefault("TORCHTOP_QUIET", "1")
    os.environ.setdefault("TORCHTOP_RUNTIME_DIR", tempfile.mkdtemp(prefix="torchtop-bench-"))
    torch.set_num_threads(1)
    block = loop(args.hidden)
    res: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            agent = start(mode)
            block(30)
            res[mode].append(block(args.steps))
            if agent is not None:
                ta.stop()
    print(
        f"MLP 256-{args.hidden}-{args.hidden}-10, batch 64; us vs off (lower quartiles, median of {args.rounds} rounds)"
    )
    for part in (*PARTS, "total"):
        base = statistics.median(d[part] for d in res["off"])
        deltas = "  ".join(
            f"{m} {statistics.median(d[part] for d in res[m]) - base:+6.2f}" for m in MODES[1:]
        )
        print(f"{part:6s} off {base:8.2f}  {deltas}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
