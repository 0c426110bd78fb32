"""The agent's cost per step, paired: torchtop's wrappers swapped in and out on alternate steps.

    python tests/benchmarks/bench_paired.py [--device cpu|cuda] [--pairs N] [--phase-every K] [--markdown]
        [--attached [--transport ipc|tcp]] [--ddp] [--after-capture p|window [--cupti-teardown off]]

`--attached`: a monitor process attaches by pid as the TUI does (tests/benchmarks/attached.py)
and listens all along; the run fails unless it received every step the agent cut meanwhile.
`--after-capture`: instead of pairs, the step time before vs after one capture
(tests/benchmarks/after_capture.py).

Its figures go in docs/benchmarks.md: `--markdown` also prints the table row to paste there.

Not collected by pytest. The agent runs all along (threads, sockets, probe); what alternates is
whether the hooked functions (DataLoader `__next__` on CPU, the root's `forward`,
`autograd.backward`, the optimizer's step in torch's wrapper cell, and on CUDA `Tensor.to`,
`.cuda`, `.copy_`) are torchtop's wrappers or the originals, in random order within each pair
of adjacent steps. Each part of the step is timed on the host (on CUDA: launch time; the loop
is launch-bound), and the difference within a pair is what the wrappers cost that step: drift
and other processes cancel, so a few thousand pairs give the cost to a microsecond or two, where
blocks of steps (bench_overhead.py) swing by more.

Only every other step runs the wrappers, so the agent would see steps twice as long as they are
and time more of them (phase sampling) and sample CUDA events more often. A free run of the
same loop first reads what the agent chooses on it (the share of steps timed, the CUDA event
stride), and the paired steps keep those. The agent's own threads run through both steps of
a pair, so their cost cancels there: their work per step (CPU time from waking to waiting again,
which holds the GIL for most of it) is measured beside it and added to the total, as if all of
it held up training. Their whole CPU time is printed too: it adds the cost of waking up, spent
in the kernel without the GIL.
The goal is judged on the total's 95% interval (bootstrap of the 10% trimmed mean): CPU <= 0.5%
of a ~2 ms step, CUDA <= 0.5% of a launch-bound ~2 ms step too. `--phase-every 1` times every step's
phases; 0 (default) is the agent's own phase sampling. Not counted: the start-up transient.

`--ddp` wraps the model in DistributedDataParallel (gloo on CPU, NCCL on CUDA): under torchrun,
one process a rank (every rank swaps the wrappers at the same steps: the pairs' order is seeded);
run plainly, a group of one rank whose backwards are marked distributed all the same, so what a
timed backward of a distributed run adds (the collective-wait callback) is in the figure.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import torch

import torchtop.agent as ta
from torchtop.agent.hooks.optimizer import _step_cell
from torchtop.agent.loop import cuda_events as cuda_timing

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attached import Monitor  # noqa: E402
from bench_overhead import GOALS, calibrate_cpu, calibrate_cuda  # noqa: E402

PARTS = ("next", "forward", "loss+zero", "backward", "optimizer", "step")


def _group(device: str) -> Any:
    """torch.distributed with a process group: torchrun's, else one of a single rank."""
    import torch.distributed as dist

    if not dist.is_initialized():
        if "RANK" in os.environ:
            dist.init_process_group("nccl" if device == "cuda" else "gloo")
        else:
            import socket

            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                init = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
            dist.init_process_group(
                "nccl" if device == "cuda" else "gloo", init_method=init, rank=0, world_size=1
            )
    return dist


def _ddp(model: Any, device: str) -> Any:
    """`model` in DistributedDataParallel over `_group`'s ranks."""
    _group(device)
    ids = [torch.cuda.current_device()] if device == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)


def _same_size(size: int, device: str) -> int:
    """Under torchrun every rank calibrates on its own: DDP needs one model, the smallest size."""
    if "RANK" not in os.environ:
        return size
    dist = _group(device)
    t = torch.tensor([size], device="cuda" if device == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def _loop(device: str, size: int, ddp: bool = False) -> tuple[Any, Any, type, str]:
    """(step returning per-part ns, model, optimizer class, description)."""
    torch.manual_seed(0)
    ns = time.perf_counter_ns
    if device == "cpu":
        model = torch.nn.Sequential(
            torch.nn.Linear(256, size),
            torch.nn.ReLU(),
            torch.nn.Linear(size, size),
            torch.nn.ReLU(),
            torch.nn.Linear(size, 10),
        )
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
        cached = [
            (torch.randn(32, 256, device="cuda"), torch.randint(0, 10, (32,), device="cuda"))
            for _ in range(16)
        ]
        it = itertools.cycle(cached)
        desc = f"MLP {size}x256, batch 32, Adam, data on the GPU (launch-bound)"
    if ddp:
        model = _ddp(model, device)
        opt = type(opt)(model.parameters(), **opt.defaults)

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


def trimmed_mean(values: list[int] | list[float]) -> float:
    d = sorted(values)
    k = len(d) // 10
    return statistics.fmean(d[k : len(d) - k])


def trimmed_ci(values: list[int], n: int = 300) -> tuple[float, float]:
    """95% bootstrap interval of the 10% trimmed mean (pairs resampled with replacement)."""
    rng = random.Random(0)
    means = sorted(trimmed_mean(rng.choices(values, k=len(values))) for _ in range(n))
    return means[int(0.025 * n)], means[int(0.975 * n) - 1]


def agent_busy_ns(agent: Any) -> tuple[int, int, int, int]:
    """CPU time so far of the agent's threads at work (each counts its own): the agent loop,
    the slow samplers, the recorder (0 without a recording), the stack sampler (which samples
    only while a monitor listens: `--attached`)."""
    why = getattr(agent, "why", None)
    return (
        agent.loop.busy_ns,
        agent.telemetry.busy_ns if agent.telemetry is not None else 0,
        agent.recorder.busy_ns if agent.recorder is not None else 0,
        why.sampler.busy_ns if why is not None else 0,
    )


def agent_threads_cpu_ns() -> int:
    """CPU time so far of the agent's threads, waking up included (Linux: a thread's CPU
    clock; 0 elsewhere)."""
    total = 0
    for t in threading.enumerate():
        if t.name.startswith("torchtop") and t.ident is not None:
            try:
                total += time.clock_gettime_ns(time.pthread_getcpuclockid(t.ident))
            except (AttributeError, OSError):
                pass
    return total


def free_run(step: Any, probe: Any, n: int) -> tuple[float, int]:
    """The agent's own choices on this loop, unpaired: the share of steps whose phases it
    times, and its CUDA event stride (0 off CUDA)."""
    timed = 0
    for _ in range(n):
        step()
        timed += probe.untimed == 0  # the next step's
    return timed / n, probe.event_every if probe.pool is not None else 0


class Hooked:
    """The functions torchtop wraps in this loop, swapped between its wrappers and the originals
    with one call: the root's `forward`, `autograd.backward`, the DataLoader's `__next__`,
    `Tensor.to/.cuda/.copy_`, and the optimizer's step in torch's wrapper cell."""

    def __init__(self, opt_cls: type, root: type = torch.nn.Sequential) -> None:
        cell = _step_cell(opt_cls.step)
        if cell is None:
            raise SystemExit("this torch's optimizer step wrapper has no cell to swap")
        self.cell = cell
        from torch.utils.data import dataloader

        dl = dataloader._BaseDataLoaderIter
        self.slots = [(root, "forward"), (torch.autograd, "backward"), (dl, "__next__")]
        self.slots += [(torch.Tensor, name) for name in ("to", "cuda", "copy_")]
        self.orig = self._now()
        self.wrapped: list[Any] = []

    def _now(self) -> list[Any]:
        return [getattr(o, n) for o, n in self.slots] + [self.cell.cell_contents]

    def installed(self) -> None:
        """After start() and a few steps: these are the wrappers."""
        self.wrapped = self._now()
        if any(a is b for a, b in zip(self.orig[:2] + self.orig[-1:], self.wrapped[:2] + self.wrapped[-1:])):
            raise SystemExit("the hooks are not installed")

    def use(self, on: bool) -> None:
        fns = self.wrapped if on else self.orig
        for (owner, name), fn in zip(self.slots, fns):
            setattr(owner, name, fn)
        self.cell.cell_contents = fns[-1]


# `--floor`: the same hook points doing only what the hot-path rules allow and nothing else, a
# clock read and two appends on each side (no thread check, no sampling, no step logic): the
# physical floor of a Python-level hook, beside which the agent's own figure is read
_FLOOR = """
def {name}({params}):
    _tt_a(_tt_pc())
    _tt_a(1)
    try:
        return _tt_orig({call})
    finally:
        _tt_a(_tt_pc())
        _tt_a(2)
"""


def floor_wrappers(fns: list[Any], sink: list[int]) -> list[Any]:
    """Append-only wrappers of `fns` (Hooked's originals), appending to `sink`."""
    from torchtop.agent.hooks.wrap import signature_wrapper

    names = {"_tt_a": sink.append, "_tt_pc": time.perf_counter_ns}
    return [signature_wrapper(fn, _FLOOR, names, getattr(fn, "__name__", "f"), True) for fn in fns]


class CommToggle:
    """`--comm-only`: the wrappers stay; a timed backward arms the collective-wait callback
    (probe.comm) on one step of each pair and not on the other."""

    def __init__(self, probe: Any) -> None:
        self.probe = probe

    def use(self, on: bool) -> None:
        self.probe.comm = on


def paired(
    step: Any, hooked: Hooked | CommToggle, pairs: int, aa: bool = False
) -> tuple[list[list[int]], list[int]]:
    """Per part, the wrapped step's time minus the unwrapped one's, for each pair of adjacent
    steps in random order; and the unwrapped steps' times. `aa`: the originals on both sides
    (a check of the estimator). Ends with the wrappers in place."""
    rng = random.Random(1)
    diffs: list[list[int]] = [[] for _ in PARTS]
    base: list[int] = []
    for _ in range(pairs):
        got = {}
        for on in (True, False) if rng.random() < 0.5 else (False, True):
            hooked.use(on and not aa)
            got[on] = step()
        for k in range(len(PARTS)):
            diffs[k].append(got[True][k] - got[False][k])
        base.append(got[False][5])
    hooked.use(True)
    return diffs, base


def one_in(share: float) -> int:
    """`phase_every` that times about `share` of the steps."""
    return max(1, round(1 / share)) if share > 0 else 1


def markdown_row(
    args: argparse.Namespace,
    size: int,
    desc: str,
    step_us: float,
    hooks_us: float,
    threads_us: float,
    total: tuple[float, float, float],
    verdict: str,
    share: float,
    every: int,
) -> str:
    """One row of docs/benchmarks.md's overhead tables: | date | machine | loop | command | result |"""
    import platform

    machine = (
        torch.cuda.get_device_name()
        if args.device == "cuda"
        else (platform.processor() or platform.machine())
    )
    machine += f", {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}"
    command = f"`bench_paired.py --device {args.device} --size {size} --pairs {args.pairs}`"
    if args.phase_every:
        command = command[:-1] + f" --phase-every {args.phase_every}`"
    for flag, on in (
        ("--attached", args.attached),
        ("--transport tcp", args.transport == "tcp"),
        ("--ddp", args.ddp),
    ):
        command = command[:-1] + f" {flag}`" if on else command
    pct, lo, hi = total
    chose = f"phases timed on {share:.0%} of steps" + (f", events 1 step in {every}" if every else "")
    result = (
        f"hooks {hooks_us:+.1f} µs + threads {threads_us:.1f} µs = **{pct:+.2%}** "
        f"(95% CI {lo:+.2%} .. {hi:+.2%}): {verdict}; {chose}"
    )
    return (
        f"| {time.strftime('%Y-%m-%d')} | {machine} | {desc}, {step_us / 1e3:.2f} ms | {command} | {result} |"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--pairs", type=int, default=5000)
    p.add_argument("--phase-every", type=int, default=0)
    p.add_argument(
        "--attached",
        action="store_true",
        help="a monitor process attached as the TUI attaches (by pid) listens all along: 10 Hz ticks, "
        "stack samples; the run fails unless it received every step",
    )
    p.add_argument(
        "--transport",
        choices=("ipc", "tcp"),
        default="ipc",
        help="where the agent listens: ipc (the default) or TCP on loopback (CURVE)",
    )
    p.add_argument("--warm-steps", type=int, default=300, help="untimed steps after start")
    p.add_argument("--free-steps", type=int, default=2000, help="the free run that reads the agent's choices")
    p.add_argument(
        "--size", type=int, default=0, help="cpu: hidden width; cuda: depth (default: calibrated to ~2 ms)"
    )
    p.add_argument("--ddp", action="store_true", help="DistributedDataParallel (under torchrun: every rank)")
    p.add_argument(
        "--comm-only",
        action="store_true",
        help="with --ddp: the wrappers stay in; what alternates is the collective-wait callback of a "
        "timed backward (probe.comm): its own cost",
    )
    p.add_argument(
        "--after-capture",
        choices=("p", "window"),
        default=None,
        help="instead of pairs: step time before vs after one capture (after_capture.py)",
    )
    p.add_argument("--block", type=int, default=3000, help="--after-capture: steps a block")
    p.add_argument(
        "--cupti-teardown",
        choices=("auto", "off"),
        default="auto",
        help="--after-capture: off keeps CUPTI attached after the capture (TORCHTOP_CUPTI_TEARDOWN=0)",
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="the paired side runs append-only wrappers at the same hook points instead of the agent's: "
        "the floor any Python hook pays (the agent's threads run as usual)",
    )
    p.add_argument("--markdown", action="store_true", help="also print the row for docs/benchmarks.md")
    p.add_argument(
        "--record", metavar="PATH", default=None, help="the agent records the run into PATH meanwhile"
    )
    args = p.parse_args(argv)
    os.environ.setdefault("TORCHTOP_QUIET", "1")
    if args.cupti_teardown == "off":
        os.environ["TORCHTOP_CUPTI_TEARDOWN"] = "0"
    os.environ.setdefault("TORCHTOP_RUNTIME_DIR", tempfile.mkdtemp(prefix="torchtop-bench-"))
    os.environ.setdefault("TORCHTOP_DIR", os.path.join(os.environ["TORCHTOP_RUNTIME_DIR"], "captures"))
    if args.device == "cpu":
        torch.set_num_threads(1)
    if args.ddp and args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    size = args.size or (calibrate_cpu(64, 2.0) if args.device == "cpu" else calibrate_cuda(32, 2.0))
    if args.ddp:
        size = _same_size(size, args.device)
    step, model, opt_cls, desc = _loop(args.device, size, args.ddp)
    hooked: Hooked | CommToggle = Hooked(opt_cls, type(model) if args.ddp else torch.nn.Sequential)
    port = 0 if args.transport == "tcp" else None
    if ta.start(port=port, phase_every=args.phase_every, record=args.record) is None:
        raise SystemExit("the agent did not start")
    agent = ta.current()
    assert agent is not None  # started just above
    probe = agent.probe  # type: ignore[union-attr]
    if args.ddp and torch.distributed.get_world_size() == 1:
        agent._identity_due = float("inf")  # type: ignore[union-attr]  # one rank: mark it distributed
        probe.comm = True
    if args.ddp:
        desc += f", DDP over {torch.distributed.get_world_size()} rank(s) ({torch.distributed.get_backend()})"
    listener = None
    if (
        args.attached
    ):  # a monitor in another process, as an open TUI: the agent ticks at 10 Hz and samples stacks
        listener = Monitor(os.getpid()).start()
    watched_from = probe.steps
    stride = cuda_timing.EventResolver.stride
    try:
        for _ in range(args.warm_steps):
            step()
        hooked.installed()
        if args.after_capture:
            import after_capture

            after_capture.run(step, agent, args.after_capture, args.block, args.device == "cuda")
            return 0
        share, every = free_run(step, probe, args.free_steps)
        # the paired steps keep the free run's choices (see the docstring)
        if not args.phase_every:
            probe.phase_every = one_in(share)
        if every:
            cuda_timing.EventResolver.stride = lambda self, current: every  # type: ignore[method-assign]

        if args.comm_only:
            hooked = CommToggle(probe)
        sink: list[int] = []
        if args.floor:
            if not isinstance(hooked, Hooked):
                raise SystemExit("--floor swaps the wrappers: not with --comm-only")
            hooked.wrapped = floor_wrappers(hooked.orig, sink)
        cpu0, busy0, wall0, ticks0 = (
            agent_threads_cpu_ns(),
            agent_busy_ns(agent),
            time.monotonic(),
            agent.loop.ticks,
        )
        diffs, base = paired(step, hooked, args.pairs)
        busy1, wall, ticks = agent_busy_ns(agent), time.monotonic() - wall0, agent.loop.ticks - ticks0
        if listener is not None:  # fails the run unless the monitor received every step
            got = listener.finish(probe.steps - watched_from)
            print(
                f"  monitor attached by pid over {got.transport}: received {got.steps} steps in {got.batches} "
                f"batches ({probe.steps - watched_from} cut while it watched; {got.seq_gaps} batches missed)"
            )
        loop_us, slow_us, rec_us, stacks_us = ((b - a) / (2 * args.pairs) / 1e3 for a, b in zip(busy0, busy1))
        threads_us = loop_us + slow_us + rec_us + stacks_us
        cpu_us = (agent_threads_cpu_ns() - cpu0) / (2 * args.pairs) / 1e3
        if args.device == "cuda":
            torch.cuda.synchronize()
        step_us = statistics.median(base) / 1e3
        print(f"{args.device}: {desc}; host step without hooks {step_us:.1f} us (median); {args.pairs} pairs")
        rec = agent.recorder
        directory = rec.directory if rec is not None else None  # its rank's, once settled
        if args.record and rec is not None and directory is not None:
            size = sum(f.stat().st_size for f in directory.iterdir())
            print(f"  recording {directory}: {size / 2**20:.2f} MiB, {rec.dropped} batches dropped")
        print(
            f"  the agent on this loop, unpaired: phases timed on {share:.1%} of steps"
            + (f", CUDA events on 1 step in {every}" if every else "")
            + f"; paired with phase_every={probe.phase_every}; hook failures {probe.failures}"
        )
        if args.floor:
            calls = len(sink) // (4 * args.pairs)
            print(
                f"  FLOOR: the paired side ran append-only wrappers ({calls} hooked calls a step), not the agent's"
            )
            if not calls:
                raise SystemExit("--floor: no floor wrapper ran: the figure would measure nothing")
        lo, hi = trimmed_ci(diffs[5])
        for k, name in enumerate(PARTS):
            ci = f", 95% CI {lo / 1e3:+.2f} .. {hi / 1e3:+.2f}" if name == "step" else ""
            print(f"  {name:10s} {trimmed_mean(diffs[k]) / 1e3:+7.2f} us (10% trimmed mean{ci})")
        hooks = trimmed_mean(diffs[5]) / 1e3
        total, lo_t, hi_t = (
            (hooks + threads_us) / step_us,
            (lo / 1e3 + threads_us) / step_us,
            (hi / 1e3 + threads_us) / step_us,
        )
        goal = GOALS[args.device]
        verdict = "meets" if hi_t <= goal else "misses" if lo_t > goal else "undecided"
        print(
            f"  agent threads at work {threads_us:+.2f} us a step (loop {loop_us:.2f}, slow samplers {slow_us:.2f}"
            + (f", recorder {rec_us:.2f}" if args.record else "")
            + f", stack sampler {stacks_us:.2f}"
            + (
                f" at {agent.why.sampler.rate:.1f} Hz"
                if listener and agent.why
                else " (idle: nobody listens)"
            )
            + "; "
            f"their whole CPU time, waking up included: {cpu_us:.2f} us)"
        )
        per_s = [(b - a) / wall / 1e6 for a, b in zip(busy0, busy1)]
        print(
            f"  agent threads' CPU per second of wall time (step-rate free; a loaded machine inflates it): "
            f"{sum(per_s):.2f} ms (loop {per_s[0]:.2f} in {ticks / wall:.1f} ticks/s, slow samplers {per_s[1]:.2f}, "
            f"stack sampler {per_s[3]:.2f}) = {sum(per_s) / 10:.3f}% of one core"
        )
        print(
            f"  overhead: hooks {hooks / step_us:+.2%} + threads {threads_us / step_us:+.2%} = {total:+.2%} of the step "
            f"(95% CI {lo_t:+.2%} .. {hi_t:+.2%}); goal <= {goal:.1%}: {verdict}"
        )
        if args.markdown:
            print(
                markdown_row(
                    args, size, desc, step_us, hooks, threads_us, (total, lo_t, hi_t), verdict, share, every
                )
            )
    finally:
        cuda_timing.EventResolver.stride = stride  # type: ignore[method-assign]
        if listener is not None:
            listener.kill()
        ta.stop()
        if args.ddp and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
