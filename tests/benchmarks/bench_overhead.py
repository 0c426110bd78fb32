"""The agent's overhead on a training loop, as a ratio against the same loop without it.

    python tests/benchmarks/bench_overhead.py [--device cpu|cuda] [--split] [--rounds R] [--steps N]

Its figures go in docs/benchmarks.md (a dated section per round).

Not collected by pytest. One process, alternating: each round times one block of N steps with
the agent on (`torchtop.agent.start()`) and one with it off (`stop()`), in alternating order so
drift cancels. Each block is preceded by untimed warm-up steps (the same for both), so the agent
is in its steady state (roots discovered, CUDA events enabled, sampling stride adapted) when its
block is timed. The headline figure is the median over rounds of (on / off) - 1 of the blocks'
median per-step times, with its IQR and a 95% bootstrap interval: robust to other processes
preempting a few steps. The goal is judged on that interval: met when all of it lies under the
goal, missed when all of it lies above, undecided when it spans the goal (too noisy a machine,
or too few rounds). The same ratio of block means (every cost counted: the agent thread's
10 Hz tick taking the GIL, garbage collection, but also any interference) is printed beside it. `--split` adds a third mode,
`start(auto=False)` (the agent's threads and sockets, no hook), to tell the hooks' share from
the threads'. `--attached` keeps a subscriber process on the batch stream all along (the agent
then sends every log chunk; unattended, it keeps them for late joiners).

- cpu: an MLP of ~2 ms a step on one thread (hidden width calibrated to ~2 ms), fed by a
  DataLoader over an in-memory TensorDataset. Goal: overhead <= 0.5%.
- cuda: a launch-bound ~2 ms step: an MLP of width 256 with small batches, so the step is many
  small kernels and the host's launch rate sets the pace (depth is calibrated to ~2 ms, starting
  from 8 layers). Blocks are bracketed by `torch.cuda.synchronize()` (outside the timed steps'
  agent boundaries). Goal: overhead <= 0.5%. It also prints the cost of the CUDA event calls.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

import torchtop.agent

GOALS = {"cpu": 0.005, "cuda": 0.005}  # the brief: 0.5% of a ~2 ms step, CPU, CUDA and DDP alike


def _median_ci(values: list[float], n: int = 2000) -> tuple[float, float]:
    """95% bootstrap interval of the median (rounds resampled with replacement): how precisely
    the headline figure is known on this machine."""
    import random

    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def _quantiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return q[0], q[1], q[2]


# -- the loops -------------------------------------------------------------------------------------
def cpu_loop(hidden: int, batch: int) -> tuple[Callable[[], None], Callable[[], None], str]:
    torch.manual_seed(0)
    n = 8192
    data = torch.utils.data.TensorDataset(torch.randn(n, 256), torch.randint(0, 10, (n,)))
    loader = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True, num_workers=0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),
    )
    loss_fn = torch.nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def batches() -> Any:
        while True:
            yield from loader

    it = batches()

    def step() -> None:
        x, y = next(it)
        loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    desc = f"MLP 256-{hidden}-{hidden}-10, batch {batch}, DataLoader(TensorDataset), 1 thread"
    return step, lambda: None, desc


def cuda_loop(depth: int, batch: int, width: int = 256) -> tuple[Callable[[], None], Callable[[], None], str]:
    torch.manual_seed(0)
    layers: list[Any] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 10)).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    data = [
        (torch.randn(batch, width, device="cuda"), torch.randint(0, 10, (batch,), device="cuda"))
        for _ in range(16)
    ]
    k = [0]

    def step() -> None:
        x, y = data[k[0] % 16]
        k[0] += 1
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    desc = f"MLP {depth}x{width}, batch {batch}, Adam, data on the GPU"
    return step, torch.cuda.synchronize, desc


def _time_steps(
    step: Callable[[], None], sync: Callable[[], None], n: int, per_step: list[float] | None = None
) -> float:
    """Mean seconds per step over n steps (synchronised at both ends); per-step host times go to per_step."""
    clock = time.perf_counter
    sync()
    t0 = last = clock()
    if per_step is None:
        for _ in range(n):
            step()
    else:
        for _ in range(n):
            step()
            now = clock()
            per_step.append(now - last)
            last = now
    sync()
    return (clock() - t0) / n


def _median_step(step: Callable[[], None], sync: Callable[[], None], n: int = 100) -> float:
    times: list[float] = []
    for _ in range(20):
        step()
    _time_steps(step, sync, n, times)
    return statistics.median(times)


def calibrate_cpu(batch: int, target_ms: float, start_hidden: int = 256) -> int:
    """Hidden width for a ~target_ms step. Time grows less than with the square of the width (the
    outer layers and the fixed costs), so guess linearly and measure again until within 5%. Medians,
    not means: the machine may be shared."""
    hidden = start_hidden
    for _ in range(5):
        t = _median_step(*cpu_loop(hidden, batch)[:2]) * 1000
        print(f"cpu calibration: hidden {hidden} -> {t:.3f} ms/step")
        if abs(t / target_ms - 1) <= 0.05:
            break
        hidden = max(32, min(4096, int(round(hidden * (target_ms / t) / 16) * 16)))
    print(f"cpu calibration: using hidden {hidden} for ~{target_ms} ms")
    return hidden


def calibrate_cuda(batch: int, target_ms: float, start_depth: int = 8) -> int:
    step, sync, _ = cuda_loop(start_depth, batch)
    for _ in range(30):
        step()
    t = _time_steps(step, sync, 200) * 1000  # launch-bound: the mean of a synchronised block
    depth = max(2, min(128, round(start_depth * target_ms / t)))
    print(
        f"cuda calibration: depth {start_depth} -> {t:.3f} ms/step; using depth {depth} for ~{target_ms} ms"
    )
    return depth


# -- CUDA event costs -----------------------------------------------------------------------------
def event_costs(n: int = 2000) -> dict[str, float]:
    """Median us per call of the CUDA event calls the agent makes (record on the training thread)."""
    ns = time.perf_counter_ns
    out: dict[str, float] = {}
    t = []
    evs = []
    for _ in range(n):
        a = ns()
        evs.append(torch.cuda.Event(enable_timing=True))
        t.append(ns() - a)
    out["Event() create"] = statistics.median(t) / 1000
    torch.cuda.synchronize()
    for label in ("record (first, creates the CUDA event)", "record (reused event)"):
        t = []
        for ev in evs:
            a = ns()
            ev.record()
            t.append(ns() - a)
        torch.cuda.synchronize()
        out[label] = statistics.median(t) / 1000
    stream = torch.cuda.current_stream()
    t = []
    for ev in evs:
        a = ns()
        ev.record(stream)
        t.append(ns() - a)
    torch.cuda.synchronize()
    out["record(stream) (stream passed, reused event)"] = statistics.median(t) / 1000
    t = []
    for ev in evs:
        a = ns()
        ev.query()
        t.append(ns() - a)
    out["query (completed)"] = statistics.median(t) / 1000
    t = []
    for a_ev, b_ev in zip(evs[::2], evs[1::2]):
        a = ns()
        a_ev.elapsed_time(b_ev)
        t.append(ns() - a)
    out["elapsed_time"] = statistics.median(t) / 1000
    t = []
    for _ in range(n):
        a = ns()
        torch.cuda.current_stream()
        t.append(ns() - a)
    out["current_stream()"] = statistics.median(t) / 1000
    return out


# -- the alternation -------------------------------------------------------------------------------
SUBSCRIBER = """
import sys, zmq
sub = zmq.Context().socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.setsockopt(zmq.SUBSCRIBE, b"\\xfewatch")  # a monitor watches (wire.WATCH_TOPIC)
sub.connect(sys.argv[1])  # the agent's ipc stream: the same path (same pid) across restarts
while True:
    sub.recv()
"""


def alternate(
    step: Callable[[], None],
    sync: Callable[[], None],
    rounds: int,
    steps: int,
    warm: int,
    split: bool = False,
    port: int | None = None,
    pin: int | None = None,
    attached: bool = False,
) -> dict[str, Any]:
    """Rounds of one block per mode, the order rotating each round. Modes: "off" (no agent),
    "on" (`start()`), and with `split` "thread" (`start(auto=False)`: the agent's threads and
    sockets without any hook), which tells the hooks' share from the threads'."""
    modes = ["on", "off", "thread"] if split else ["on", "off"]
    all_cores = os.sched_getaffinity(0)
    means: dict[str, list[float]] = {m: [] for m in modes}  # block means (every cost counts)
    lows: dict[str, list[float]] = {m: [] for m in modes}  # block lower quartiles of per-step times
    meds: dict[str, list[float]] = {m: [] for m in modes}  # block medians of per-step times
    strides: list[int] = []
    misses = dropped = failures = listened = 0
    for r in range(rounds):
        k = r % len(modes)
        order = modes[k:] + modes[:k]
        if r // len(modes) % 2:
            order.reverse()
        for mode in order:
            gc.collect()
            agent = None
            if pin is not None:  # the agent's threads start free to run anywhere...
                os.sched_setaffinity(0, all_cores)
            if mode != "off":
                agent = torchtop.agent.start(port=port, auto=mode == "on")
                if agent is None:
                    raise SystemExit("the agent did not start")
                # the subscriber reconnects to the restarted agent's socket: its block starts watched
                until = time.monotonic() + 5.0
                while attached and not agent.loop.subscribed and time.monotonic() < until:
                    time.sleep(0.01)
            if pin is not None:  # ...while this (training) thread stays on one core: no migrations
                os.sched_setaffinity(0, {pin})
            for _ in range(warm):
                step()
            times: list[float] = []
            means[mode].append(_time_steps(step, sync, steps, times))
            meds[mode].append(statistics.median(times))
            lows[mode].append(statistics.quantiles(times, n=4)[0])
            if agent is not None:
                if mode == "on":
                    strides.append(agent.probe.event_every if agent.probe.pool is not None else 0)
                    pool = agent.loop.resolver.pool
                    misses += pool.misses if pool is not None else 0
                    dropped += agent.probe.dropped
                    failures += agent.probe.failures
                    listened += agent.loop.subscribed
                torchtop.agent.stop()
    out: dict[str, Any] = {
        "step_ms_off": statistics.median(meds["off"]) * 1000,
        "block_mean_ms_off": statistics.median(means["off"]) * 1000,
        "rounds": rounds,
        "steps": steps,
        "warm": warm,
        "event_every": sorted(set(strides)),
        "pool_misses": misses,
        "dropped": dropped,
        "hook_failures": failures,
        "blocks_with_a_subscriber": listened,
    }
    for mode in modes:
        if mode == "off":
            continue
        suffix = "" if mode == "on" else f"_{mode}"
        ratios = [a / b - 1 for a, b in zip(meds[mode], meds["off"])]
        q1, med, q3 = _quantiles(ratios)
        m1, mmed, m3 = _quantiles([a / b - 1 for a, b in zip(means[mode], means["off"])])
        l1, lmed, l3 = _quantiles([a / b - 1 for a, b in zip(lows[mode], lows["off"])])
        out |= {
            f"step_ms{suffix or '_on'}": statistics.median(meds[mode]) * 1000,
            f"overhead{suffix}": med,  # median over rounds of the paired ratio of per-step medians
            f"overhead{suffix}_iqr": [q1, q3],
            f"overhead{suffix}_ci95": list(_median_ci(ratios)),
            f"overhead{suffix}_mean": mmed,  # the same on block means
            f"overhead{suffix}_mean_iqr": [m1, m3],
            f"overhead{suffix}_p25": lmed,  # the same on the blocks' lower quartiles: preemption filtered out
            f"overhead{suffix}_p25_iqr": [l1, l3],
        }
    for mode in modes:
        out[f"blocks_{mode}_ms"] = [round(x * 1000, 5) for x in means[mode]]
        out[f"block_medians_{mode}_ms"] = [round(x * 1000, 5) for x in meds[mode]]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--rounds", type=int, default=0, help="on/off block pairs (default cpu 100, cuda 40)")
    p.add_argument(
        "--steps", type=int, default=0, help="timed steps per block (default: ~0.1 s cpu, 0.2 s cuda)"
    )
    p.add_argument(
        "--warm",
        type=int,
        default=0,
        help="untimed steps after each start/stop (default: 10 cpu; ~0.3 s cuda, so the "
        "event sampling stride has adapted)",
    )
    p.add_argument(
        "--hidden", type=int, default=0, help="cpu: MLP hidden width (default: calibrated to ~2 ms)"
    )
    p.add_argument("--batch", type=int, default=0, help="batch size (cpu 64, cuda 32)")
    p.add_argument("--depth", type=int, default=0, help="cuda: MLP depth (default: calibrated to ~2 ms)")
    p.add_argument("--target-ms", type=float, default=2.0, help="step time the calibration aims at")
    p.add_argument(
        "--split",
        action="store_true",
        help="also time the agent without hooks (start(auto=False)): the threads' share",
    )
    p.add_argument(
        "--attached",
        action="store_true",
        help="a subscriber process listens to the agent all along (as an open TUI does)",
    )
    p.add_argument(
        "--pin",
        type=int,
        default=-1,
        help="keep the training thread on this core (default: the last one, with >= 4 cores; "
        "-2: do not pin); the agent's threads stay free",
    )
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args(argv)

    os.environ.setdefault("TORCHTOP_QUIET", "1")
    os.environ.setdefault("TORCHTOP_RUNTIME_DIR", tempfile.mkdtemp(prefix="torchtop-bench-"))
    extra: dict[str, Any] = {}
    if args.device == "cpu":
        torch.set_num_threads(1)
        hidden = args.hidden or calibrate_cpu(args.batch or 64, args.target_ms)
        step, sync, desc = cpu_loop(hidden, args.batch or 64)
        name = "cpu"
    else:
        if not torch.cuda.is_available():
            print("cuda: no CUDA device here", file=sys.stderr)
            return 2
        torch.cuda.init()
        name = torch.cuda.get_device_name()
        batch = args.batch or 32
        costs = event_costs()
        extra["event_costs_us"] = costs
        print(f"cuda event costs on {name} (median us per call):")
        for k, v in costs.items():
            print(f"  {k:42s} {v:7.2f}")
        depth = args.depth or calibrate_cuda(batch, args.target_ms)
        step, sync, desc = cuda_loop(depth, batch)
        name = f"cuda ({name})"
    per_step = _median_step(step, sync)
    # short blocks, many rounds: an on block and its off partner see the same machine conditions
    cuda = args.device == "cuda"
    rounds = args.rounds or (40 if cuda else 100)
    steps = args.steps or max(20, int((0.2 if cuda else 0.1) / per_step))
    warm = args.warm or (max(20, int(0.3 / per_step)) if cuda else 10)
    print(
        f"{args.device}: {desc}; {per_step * 1000:.3f} ms/step; {rounds} rounds x {steps} steps "
        f"(+{warm} warm-up steps a block)",
        flush=True,
    )
    port, listener = None, None
    if args.attached:
        import subprocess

        agent = torchtop.agent.start(auto=False)  # ipc: the same socket path for every block
        if agent is None:
            raise SystemExit("the agent did not start")
        stream = agent.sockets.pub_address
        torchtop.agent.stop()
        listener = subprocess.Popen([sys.executable, "-c", SUBSCRIBER, stream])
    try:
        cores = sorted(os.sched_getaffinity(0))
        pin = (
            None
            if args.pin == -2 or (args.pin == -1 and len(cores) < 4)
            else (cores[-1] if args.pin == -1 else args.pin)
        )
        res = alternate(step, sync, rounds, steps, warm, args.split, port, pin, args.attached)
        res["pinned_core"] = pin
    finally:
        if listener is not None:
            listener.kill()
    res["attached"] = args.attached
    res.update(extra, device=args.device, name=name, loop=desc, torch=torch.__version__)
    goal = GOALS[args.device]
    q1, q3 = res["overhead_iqr"]
    c1, c3 = res["overhead_ci95"]
    # judged on the interval, not the point: a noisy machine gives an undecided run, not a pass
    verdict = "meets" if c3 <= goal else "MISSES" if c1 > goal else "undecided (the interval spans it)"
    m1, m3 = res["overhead_mean_iqr"]
    print(
        f"{args.device:5s} step {res['step_ms_off']:.3f} ms  overhead {res['overhead']:+.2%}  "
        f"(95% CI {c1:+.2%} .. {c3:+.2%}; IQR {q1:+.2%} .. {q3:+.2%}; median per-step time, "
        f"{rounds} rounds x {steps} steps)  goal <= {goal:.1%}: {verdict}  "
        f"[{name}{', attached' if args.attached else ', unattended'}]"
    )
    print(
        f"      block means: step {res['block_mean_ms_off']:.3f} ms  overhead {res['overhead_mean']:+.2%}  "
        f"(IQR {m1:+.2%} .. {m3:+.2%}; every cost counted, also interference from other processes)"
    )
    l1, l3 = res["overhead_p25_iqr"]
    pinned = "" if res["pinned_core"] is None else f"; training thread on core {res['pinned_core']}"
    print(
        f"      blocks' lower quartiles: overhead {res['overhead_p25']:+.2%}  (IQR {l1:+.2%} .. {l3:+.2%}; "
        f"preemptions filtered out){pinned}"
    )
    if args.split:
        t1, t3 = res["overhead_thread_iqr"]
        print(
            f"      agent threads alone (no hooks): overhead {res['overhead_thread']:+.2%}  "
            f"(IQR {t1:+.2%} .. {t3:+.2%}); block means {res['overhead_thread_mean']:+.2%}"
        )
    if args.attached:
        print(
            f"      a subscriber listened at the end of {res['blocks_with_a_subscriber']} of {rounds} 'on' blocks"
        )
        if res["blocks_with_a_subscriber"] < rounds:  # an unwatched block: not an attached figure
            raise SystemExit("the subscriber missed 'on' blocks: this run's figure is not an attached one")
    if args.device == "cuda":
        print(
            f"      sample stride seen {res['event_every']}, pool misses {res['pool_misses']}, "
            f"dropped {res['dropped']}, hook failures {res['hook_failures']}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
