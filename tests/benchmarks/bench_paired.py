"""The hooks' cost per step, paired: torchtop's wrappers swapped in and out on alternate steps.

    python tests/benchmarks/bench_paired.py [--device cpu|cuda] [--pairs N] [--phase-every K]

Not collected by pytest. The agent runs all along (threads, sockets, probe); what alternates is
whether the hooked functions (DataLoader `__next__` on CPU, the root's `forward`,
`autograd.backward`, the optimizer's step in torch's wrapper cell) are torchtop's wrappers or
the originals, in random order within each pair of adjacent steps. Each part of the step is
timed on the host (on CUDA: launch time; the loop is launch-bound), and the difference within a
pair is what the wrappers cost that step: drift and other processes cancel, so a few thousand
pairs give the cost to a microsecond, where blocks of steps (bench_overhead.py) swing by more.
It leaves out what only runs unpaired: the agent thread's ticks (bench_agent_thread.py) and the
start-up transient. `--phase-every 1` times every step's phases; 0 (default) is the agent's own
phase sampling.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

import torchtop.agent as ta
from torchtop.agent.hooks_optimizer import _step_cell

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_overhead import calibrate_cpu, calibrate_cuda  # noqa: E402


def _loop(device: str, size: int) -> tuple[Any, Any, type, str]:
    """(step returning per-part ns, model, optimizer class, description)."""
    torch.manual_seed(0)
    ns = time.perf_counter_ns
    if device == "cpu":
        model = torch.nn.Sequential(torch.nn.Linear(256, size), torch.nn.ReLU(), torch.nn.Linear(size, size),
                                    torch.nn.ReLU(), torch.nn.Linear(size, 10))
        opt: Any = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        data = torch.utils.data.TensorDataset(torch.randn(8192, 256), torch.randint(0, 10, (8192,)))
        loader = torch.utils.data.DataLoader(data, batch_size=64, shuffle=True)

        def batches() -> Any:
            while True:
                yield from loader

        it = batches()
        desc = f"MLP 256-{size}-{size}-10, batch 64, SGD, DataLoader(TensorDataset), 1 thread"
    else:
        layers: list[Any] = []
        for _ in range(size):
            layers += [torch.nn.Linear(256, 256), torch.nn.ReLU()]
        model = torch.nn.Sequential(*layers, torch.nn.Linear(256, 10)).cuda()
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        cached = [(torch.randn(32, 256, device="cuda"), torch.randint(0, 10, (32,), device="cuda")) for _ in range(16)]
        it = itertools.cycle(cached)
        desc = f"MLP {size}x256, batch 32, Adam, data on the GPU (launch-bound)"

    def step() -> tuple[int, ...]:
        t0 = ns()
        x, y = next(it)
        t1 = ns()
        out = model(x)
        t2 = ns()
        loss = torch.nn.functional.cross_entropy(out, y)
        opt.zero_grad(set_to_none=True)
        t3 = ns()
        loss.backward()
        t4 = ns()
        opt.step()
        t5 = ns()
        return t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t5 - t0

    return step, model, type(opt), desc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--pairs", type=int, default=5000)
    p.add_argument("--phase-every", type=int, default=0)
    p.add_argument("--size", type=int, default=0, help="cpu: hidden width; cuda: depth (default: calibrated to ~2 ms)")
    args = p.parse_args(argv)
    os.environ.setdefault("TORCHTOP_QUIET", "1")
    os.environ.setdefault("TORCHTOP_RUNTIME_DIR", tempfile.mkdtemp(prefix="torchtop-bench-"))
    if args.device == "cpu":
        torch.set_num_threads(1)
    size = args.size or (calibrate_cpu(64, 2.0) if args.device == "cpu" else calibrate_cuda(32, 2.0))
    step, model, opt_cls, desc = _loop(args.device, size)
    dl = torch.utils.data.dataloader._BaseDataLoaderIter
    cell = _step_cell(opt_cls.step)
    if cell is None:
        raise SystemExit("this torch's optimizer step wrapper has no cell to swap")
    slots = [(torch.nn.Sequential, "forward"), (torch.autograd, "backward"), (dl, "__next__")]
    orig = [getattr(o, n) for o, n in slots] + [cell.cell_contents]
    if ta.start(phase_every=args.phase_every) is None:
        raise SystemExit("the agent did not start")
    try:
        for _ in range(300):
            step()
        wrapped = [getattr(o, n) for o, n in slots] + [cell.cell_contents]
        if any(a is b for a, b in zip(orig[:2] + orig[3:], wrapped[:2] + wrapped[3:])):
            raise SystemExit("the hooks are not installed")

        def use(fns: list[Any]) -> None:
            for (owner, name), fn in zip(slots, fns):
                setattr(owner, name, fn)
            cell.cell_contents = fns[-1]

        rng = random.Random(1)
        diffs: list[list[int]] = [[] for _ in range(6)]
        base: list[int] = []
        for _ in range(args.pairs):
            got = {}
            for on in ((True, False) if rng.random() < 0.5 else (False, True)):
                use(wrapped if on else orig)
                got[on] = step()
            for k in range(6):
                diffs[k].append(got[True][k] - got[False][k])
            base.append(got[False][5])
        use(wrapped)
        if args.device == "cuda":
            torch.cuda.synchronize()
        probe = ta.current().probe  # type: ignore[union-attr]
        step_us = statistics.median(base) / 1e3
        print(f"{args.device}: {desc}; host step without hooks {step_us:.1f} us (median); {args.pairs} pairs; "
              f"phase_every={args.phase_every}; hook failures {probe.failures}")
        for k, name in enumerate(("next", "forward", "loss+zero", "backward", "optimizer", "step")):
            d = sorted(diffs[k])
            trimmed = statistics.fmean(d[len(d) // 10: -len(d) // 10])
            se = statistics.stdev(d) / len(d) ** 0.5
            print(f"  {name:10s} {trimmed / 1e3:+7.2f} us (10% trimmed mean; mean {statistics.fmean(d) / 1e3:+.2f}, "
                  f"s.e. {se / 1e3:.2f})")
        d = sorted(diffs[5])
        print(f"  step: {statistics.fmean(d[len(d) // 10: -len(d) // 10]) / 1e3 / step_us * 100:+.2f}% of the host step")
    finally:
        ta.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
