"""What each kind of step costs: bench_paired.py's pairs, with the agent's choices pinned.

    python tests/benchmarks/bench_modes.py [--device cpu|cuda] [--pairs N]

Its figures go in docs/benchmarks.md (a dated section per round).

Not collected by pytest. The same loop and pairing as bench_paired.py, in sessions that each
force one kind of step on the wrapped side: every step untimed (only its end logged), every
step's phases timed, and on CUDA every step (or 1 in 8) with CUDA events, then the agent's
default as it runs on this loop (its timed share and event stride read from a free run) and the
default unpinned. An A/A session (the originals on both sides) checks the estimator. The last
line puts the parts together: untimed + share x timed extra + event-step extra / stride.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from typing import Any

import torch

import torchtop.agent as ta
from torchtop.agent.hooks import phase_sampling
from torchtop.agent.hooks import probe as probe_mod
from torchtop.agent.loop import cuda_events as cuda_timing

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_overhead import calibrate_cpu, calibrate_cuda  # noqa: E402
from bench_paired import PARTS, Hooked, _loop, free_run, one_in, paired, trimmed_ci, trimmed_mean  # noqa: E402

FORCE: dict[str, int | None] = {"untimed": None, "every": None}


def _pin() -> None:
    """The probe's plan and the resolver's stride follow FORCE where it says so."""
    plan, stride = probe_mod.Probe._plan, cuda_timing.EventResolver.stride

    def _plan(self: Any, one_in: int, batch: int) -> None:
        if FORCE["untimed"] is None:
            return plan(self, one_in, batch)
        self.plan = [FORCE["untimed"]] * (batch + 1)
        self.untimed = FORCE["untimed"]

    def _stride(self: Any, current: int) -> int:
        return stride(self, current) if FORCE["every"] is None else FORCE["every"]

    probe_mod.Probe._plan = _plan  # type: ignore[method-assign]
    cuda_timing.EventResolver.stride = _stride  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--pairs", type=int, default=2500)
    args = p.parse_args(argv)
    os.environ.setdefault("TORCHTOP_QUIET", "1")
    os.environ.setdefault("TORCHTOP_RUNTIME_DIR", tempfile.mkdtemp(prefix="torchtop-bench-"))
    if args.device == "cpu":
        torch.set_num_threads(1)
    _pin()
    size = calibrate_cpu(64, 2.0) if args.device == "cpu" else calibrate_cuda(32, 2.0)
    step, _, opt_cls, desc = _loop(args.device, size)
    hooked = Hooked(opt_cls)
    agent = ta.start()
    if agent is None:
        raise SystemExit("the agent did not start")
    probe = agent.probe
    try:
        for _ in range(300):
            step()
        hooked.installed()
        share, every = free_run(step, probe, 2000)
        print(
            f"{args.device}: {desc}; the agent's own choices: phases timed on {share:.1%} of steps"
            + (f", CUDA events on 1 step in {every}" if every else "")
        )

        def session(
            name: str, light: int | None, ev: int | None, phase_every: int = 0, aa: bool = False
        ) -> float:
            FORCE["untimed"], FORCE["every"] = light, ev
            probe.phase_every = phase_every
            if ev is not None:
                probe.event_every = ev
            probe.left = 1  # housekeeping at the next step end applies it
            for _ in range(100):
                step()
            diffs, base = paired(step, hooked, args.pairs, aa)
            host = statistics.median(base) / 1e3
            us = trimmed_mean(diffs[5]) / 1e3
            lo, hi = trimmed_ci(diffs[5])
            print(
                f"[{name}] {us:+.2f} us a step (95% CI {lo / 1e3:+.2f} .. {hi / 1e3:+.2f}) = {us / host:+.2%} of "
                f"{host:.0f} us; "
                + ", ".join(f"{p} {trimmed_mean(d) / 1e3:+.2f}" for p, d in zip(PARTS[:5], diffs[:5]))
            )
            return us

        session("A/A: the originals on both sides", None, None, aa=True)
        untimed = session("every step untimed", phase_sampling.UNTIMED, 0)
        timed = session("every step timed", 0, 0)
        evented = session("every step with CUDA events", None, 1) if every else 0.0
        if every:
            session("CUDA events on 1 step in 8", None, 8)
        session("the default as it runs here", None, every or 0, phase_every=one_in(share))
        session("the default, unpinned (the agent sees every other step)", None, None)
        model = untimed + share * (timed - untimed) + ((evented - timed) / every if every else 0.0)
        print(
            f"parts: untimed {untimed:.2f} + {share:.3f} x timed extra {timed - untimed:.2f}"
            + (f" + event-step extra {evented - timed:.2f} / {every}" if every else "")
            + f" = {model:.2f} us a step"
        )
    finally:
        FORCE["untimed"] = FORCE["every"] = None
        ta.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
