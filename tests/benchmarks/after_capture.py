"""bench_paired.py --after-capture p|window: is the run slower after a capture than before it?

A capture cannot be undone, so its steps cannot alternate with unprofiled ones: four blocks of
N steps run back to back, B1 and B2 before the capture and A1 and A2 after it. The figures are
A1 - B2 (the step time across the capture) beside the drift between two blocks with nothing
between them (B2 - B1 and A2 - A1: how far apart two blocks read on this host anyway), and what
the capture left behind with a steady drift taken out: (A1 - B2) - ((B2 - B1) + (A2 - A1)) / 2.
Each is made of 10% trimmed means of the per-step host times (on CUDA a launch-bound loop: launch
time, where CUPTI's callbacks land), with a 95% bootstrap interval. The capture:
- `p`: what the TUI's `p` key asks for: `capture-profile` (5 steps, CPU + CUDA activity) sent to
  the agent over its socket, as a monitor does; A starts once its files are written.
- `window`: a one-step torch.profiler window of CUDA activity only (CPU on a CPU run), the kind
  a periodic GPU-timeline sample takes, stopped the way torchtop stops its own (capture/cupti.py).
`--cupti-teardown off` (TORCHTOP_CUPTI_TEARDOWN=0) keeps CUPTI attached after either: run both
ways to see what the teardown buys.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

STEP = 5  # index of the whole step's time in bench_paired's step() tuple


def _trimmed(d: list[int]) -> float:
    d = sorted(d)
    k = len(d) // 10
    return statistics.fmean(d[k : len(d) - k])


def diff_ci(after: list[int], before: list[int], n: int = 300) -> tuple[float, float, float]:
    """Trimmed mean of `after` minus that of `before`, with a 95% bootstrap interval (ns)."""
    rng = random.Random(0)
    diffs = sorted(
        _trimmed(rng.choices(after, k=len(after))) - _trimmed(rng.choices(before, k=len(before)))
        for _ in range(n)
    )
    return _trimmed(after) - _trimmed(before), diffs[int(0.025 * n)], diffs[int(0.975 * n) - 1]


def left_behind_ci(
    b1: list[int], b2: list[int], a1: list[int], a2: list[int], n: int = 300
) -> tuple[float, float, float]:
    """(A1 - B2) - ((B2 - B1) + (A2 - A1)) / 2 = 1.5 (A1 - B2) + 0.5 (B1 - A2), with a 95% bootstrap
    interval (ns): a drift steady across the four blocks cancels, a step cost the capture left
    does not."""

    def est(x1: list[int], x2: list[int], y1: list[int], y2: list[int]) -> float:
        return 1.5 * (_trimmed(y1) - _trimmed(x2)) + 0.5 * (_trimmed(x1) - _trimmed(y2))

    rng = random.Random(0)
    boot = sorted(
        est(*(rng.choices(b, k=len(b)) for b in (b1, b2, a1, a2)))  # type: ignore[arg-type]
        for _ in range(n)
    )
    return est(b1, b2, a1, a2), boot[int(0.025 * n)], boot[int(0.975 * n) - 1]


def block(step: Callable[[], tuple[int, ...]], n: int) -> list[int]:
    return [step()[STEP] for _ in range(n)]


def capture_p(step: Callable[[], tuple[int, ...]], agent: Any) -> str:
    """The TUI's `p`: a capture request over the agent's socket; steps run until it is written."""
    from torchtop.contract.wire import CaptureState
    from torchtop.monitor.link.client import AgentClient
    from torchtop.monitor.link.targets import from_discovery

    client = AgentClient(from_discovery(agent.discovery_info()))
    try:
        reply = client.request("capture-profile", {}, timeout=10)
    finally:
        client.close()
    if not reply.ok:
        raise SystemExit(f"the capture was refused: {reply.error}")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for _ in range(10):
            step()
        c = agent.captures.current
        if c is not None and c.state in (CaptureState.DONE, CaptureState.FAILED):
            if c.state == CaptureState.FAILED:
                raise SystemExit(f"the capture failed: {c.error}")
            return f"capture {c.id}: {c.steps_done} steps profiled into {c.path}"
    raise SystemExit("the capture did not finish within 120 s")


def capture_window(step: Callable[[], tuple[int, ...]], cuda: bool) -> str:
    """A one-step torch.profiler window (CUDA activity on CUDA), stopped as torchtop stops its own."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from torchtop.agent.capture import cupti

    prof = profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU])
    prof.start()
    step()
    if cuda:
        torch.cuda.synchronize()
    kept = cupti.stop(prof, torch, cuda)
    return "one-step window; CUPTI " + (f"left attached ({kept})" if kept else "torn down")


def run(step: Callable[[], tuple[int, ...]], agent: Any, mode: str, n: int, cuda: bool) -> None:
    b1 = block(step, n)
    b2 = block(step, n)
    what = capture_p(step, agent) if mode == "p" else capture_window(step, cuda)
    if mode == "p":
        kept = agent.captures.cupti_kept
        what += "; CUPTI " + (f"left attached ({kept})" if kept else "torn down")
    block(step, 50)  # the profiler's own aftermath (buffers freed, the writer thread done)
    a1 = block(step, n)
    a2 = block(step, n)
    base = _trimmed(b2)
    teardown = os.environ.get("TORCHTOP_CUPTI_TEARDOWN", "auto")
    print(f"after-capture ({mode}, TORCHTOP_CUPTI_TEARDOWN={teardown}): {what}")
    print(
        f"  blocks of {n} steps: B1, B2 before, A1, A2 after; B2 step {base / 1e3:.1f} us (10% trimmed mean)"
    )
    left = left_behind_ci(b1, b2, a1, a2)
    for name, (d, lo, hi) in (
        ("A1 - B2 (across the capture)", diff_ci(a1, b2)),
        ("B2 - B1 (drift before)", diff_ci(b2, b1)),
        ("A2 - A1 (drift after)", diff_ci(a2, a1)),
        ("left behind, drift out", left),
    ):
        print(
            f"  {name:29s} {d / 1e3:+8.2f} us = {d / base:+.2%} (95% CI {lo / base:+.2%} .. {hi / base:+.2%})"
        )
    _, lo, hi = left
    verdict = "slower after" if lo > 0 else "faster after" if hi < 0 else "nothing left behind (CI spans 0)"
    print(f"  verdict: {verdict}")
