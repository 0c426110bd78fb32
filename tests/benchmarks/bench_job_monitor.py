"""The job view's own CPU with a large job: 64 ranks at 200 steps/s each (synthetic feed).

    python tests/benchmarks/bench_job_monitor.py [--ranks 64] [--rate 200] [--seconds 30]

Not collected by pytest. A feeder process plays 64 agents on loopback, each with the agent's own
sockets and wire: a ROUTER answering hello and snapshot, an XPUB sending a batch every 0.1 s with
that tick's log chunk (the pairs a CPU run ships: 20 steps of 5 ms, a quarter of them with their
phases timed, as the agent's phase sampling does at that step time in a distributed run, each
with a collective wait)
and telemetry. This process runs the real job view (JobApp, headless, 120x40, the Ranks tab) on
them and measures its own CPU time (every thread: the Textual loop and the feed worker) over the
steady part of the run. The goal: under 25% of one core; a run that receives under 95% of the
batches sent fails (exit 1) whatever its CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import random
import resource
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from multiprocessing.synchronize import Event

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import zmq  # noqa: E402

from torchtop.contract import logcodes as lc  # noqa: E402
from torchtop.contract import wire  # noqa: E402

TICK_S = 0.1


def _step(t: int, step_ns: int, timed: bool, slow: bool) -> list[int]:
    if not timed:
        return [t + step_ns, lc.UNTIMED_END]
    data = step_ns // (3 if slow else 40)
    comm = step_ns // (20 if slow else 2)
    marks = [
        (0, lc.DATA), (data, lc.EXIT | lc.DATA), (data + 10_000, lc.FORWARD_START + 3),
        (data + 600_000, lc.EXIT | lc.FORWARD), (data + 610_000, lc.BACKWARD),
        (step_ns - comm - 300_000, lc.COMM_READY), (step_ns - 300_000, lc.EXIT | lc.BACKWARD),
        (step_ns - 250_000, lc.OPTIMIZER), (step_ns, lc.STEP_END),
    ]  # fmt: skip
    out = []
    for dt, code in marks:
        out += [t + dt, code]
    return out


def feeder(ports: list[int], rate: float, seconds: float, ready: Event, timed: float | None = None) -> None:
    """Plays one agent per port pair until `seconds` have gone."""
    ctx = zmq.Context()
    agents = []
    start = time.time()
    for rank, port in enumerate(ports):
        router, pub = ctx.socket(zmq.ROUTER), ctx.socket(zmq.XPUB)
        router.bind(f"tcp://127.0.0.1:{port}")
        pub.bind(f"tcp://127.0.0.1:{port + 1}")
        hello = wire.Hello(
            v=wire.PROTOCOL_VERSION, run_id=f"run{rank:04d}", pid=10_000 + rank, host=f"node{rank // 8}",
            port=port, pub_port=port + 1, device="cpu", start_time=start, rank=rank, world_size=len(ports),
            local_rank=rank % 8, agent_version="0.1.0", job_id="bench@node0:29500", launcher="torchrun",
        )  # fmt: skip
        agents.append({"router": router, "pub": pub, "hello": hello, "seq": 0, "chunk": 0, "steps": 0})
    ready.set()
    step_ns = int(1e9 / rate)
    per_tick = int(rate * TICK_S)
    t_ns = time.perf_counter_ns()
    wall_offset = time.time() - t_ns / 1e9
    host = wire.HostSample(proc_cpu=99.0, proc_rss=2**31, threads=12, cpu_count=96)
    next_tick = time.monotonic()
    rng = random.Random(0)
    from torchtop.agent.hooks.phase_sampling import COMM_FULL_STEP_NS

    # the agent's phase sampling (probe.py), unless --timed says
    timed_share = min(1.0, step_ns / COMM_FULL_STEP_NS) if timed is None else timed
    while time.time() - start < seconds:
        for a in agents:
            while True:
                try:
                    frames = a["router"].recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                req = wire.decode(frames[-1])
                assert isinstance(req, wire.Request)  # a monitor sends nothing else
                reply = wire.Reply(v=wire.PROTOCOL_VERSION, id=req.id, ok=True, seq=a["seq"] - 1)
                if req.cmd == "hello":
                    reply.hello = a["hello"]
                elif req.cmd == "snapshot":
                    reply.run_id, reply.wall_offset = a["hello"].run_id, wall_offset
                a["router"].send_multipart([*frames[:-1], wire.encode(reply)])
            try:
                while a["pub"].recv(zmq.NOBLOCK):
                    pass
            except zmq.Again:
                pass
        now = time.monotonic()
        if now < next_tick:
            time.sleep(min(0.01, next_tick - now))
            continue
        next_tick += TICK_S
        for rank, a in enumerate(agents):
            raw: list[lc.Item] = []
            t = t_ns
            for _ in range(per_tick):
                raw += _step(t, step_ns, rng.random() < timed_share, rank == 37)
                t += step_ns
            a["steps"] += per_tick
            chunk = wire.LogChunk(a["chunk"], a["steps"], raw, True)
            a["chunk"] += 1
            batch = wire.Batch(
                v=wire.PROTOCOL_VERSION, run_id=a["hello"].run_id, seq=a["seq"], time=time.time(), log=[chunk],
                wall_offset=wall_offset, rank=rank, telemetry=wire.Telemetry(time=time.time(), host=host),
            )  # fmt: skip
            a["seq"] += 1
            try:
                a["pub"].send(wire.encode(batch), zmq.NOBLOCK)
            except zmq.Again:
                pass
        t_ns += per_tick * step_ns


def free_pairs(n: int) -> list[int]:
    """n loopback ports p with p and p + 1 free now."""
    import socket

    out: list[int] = []
    while len(out) < n:
        p = random.randrange(20000, 60000, 2)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", p))
                b.bind(("127.0.0.1", p + 1))
        except OSError:
            continue
        if p not in out:
            out.append(p)
    return out


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def thread_cpu() -> dict[str, float]:
    """CPU seconds so far of each thread of this process, by name (Linux)."""
    import threading

    out: dict[str, float] = {}
    for t in threading.enumerate():
        try:
            cpu = time.clock_gettime(time.pthread_getcpuclockid(t.ident))  # type: ignore[arg-type]
        except (AttributeError, OSError, TypeError):
            continue
        name = t.name.split("-")[0] if t.name.startswith("torchtop-job") else t.name
        out[name] = out.get(name, 0.0) + cpu
    return out


async def monitor(ports: list[int], seconds: float, warm: float) -> tuple[float, float, int]:
    from torchtop.monitor.link.job_targets import JobPlan
    from torchtop.monitor.link.targets import Endpoint
    from torchtop.monitor.tui.job_app import JobApp

    plan = JobPlan(
        [Endpoint.tcp("127.0.0.1", p, None, f"rank{k}") for k, p in enumerate(ports)], "bench@node0:29500"
    )
    app = JobApp(plan)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause(warm)
        steps0 = sum(m.stats.last_t0 > 0 for m in app.job.members.values())
        c0, w0, t0 = cpu_s(), time.monotonic(), thread_cpu()
        n0 = sum(m.state.batches for m in app.job.members.values())
        await pilot.pause(seconds)
        c1, w1, t1 = cpu_s(), time.monotonic(), thread_cpu()
        by_thread = {k: (t1[k] - t0.get(k, 0.0)) / (w1 - w0) for k in t1}
        print(
            "by thread:",
            ", ".join(f"{k} {v:.1%}" for k, v in sorted(by_thread.items(), key=lambda x: -x[1]) if v > 0.002),
        )
        n1 = sum(m.state.batches for m in app.job.members.values())
        text = app.ranks_panel.plain()
    print(text[:1500])
    return (c1 - c0) / (w1 - w0), (n1 - n0) / (w1 - w0), steps0


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--rate", type=float, default=200.0, help="steps/s of each rank")
    p.add_argument("--seconds", type=float, default=30.0, help="measured span")
    p.add_argument(
        "--warm", type=float, default=15.0, help="seconds before measuring (connect, fill windows)"
    )
    p.add_argument(
        "--timed",
        type=float,
        default=None,
        help="share of steps with their phases timed (default: the agent's)",
    )
    args = p.parse_args()
    ports = free_pairs(args.ranks)
    ready = mp.Event()
    proc = mp.Process(
        target=feeder, args=(ports, args.rate, args.warm + args.seconds + 20, ready, args.timed), daemon=True
    )
    proc.start()
    if not ready.wait(30) or not proc.is_alive():
        raise SystemExit("the feeder did not start (see above)")
    share, batches, steps_seen = asyncio.run(monitor(ports, args.seconds, args.warm))
    proc.terminate()
    want = args.ranks / TICK_S
    print(
        f"\nranks {args.ranks} x {args.rate:g} steps/s ({args.ranks * args.rate:,.0f} steps/s): monitor CPU "
        f"{share * 100:.1f}% of one core over {args.seconds:g} s; batches {batches:,.0f}/s of {want:,.0f}/s sent"
    )
    received = batches / want
    if received < 0.95:  # a monitor that receives nothing must not pass on its CPU
        print(f"received {received:.0%} of what was sent (< 95%): FAIL, whatever the CPU")
        return 1
    print("goal: under 25% of one core:", "meets" if share < 0.25 else "misses")
    if steps_seen < args.ranks or batches < 0.9 * want:  # a monitor that received less measured less
        raise SystemExit(
            f"the job view heard {steps_seen} of {args.ranks} ranks' steps and {batches:,.0f} of {want:,.0f} "
            "batches/s: its CPU figure is not of a monitor watching this job"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
