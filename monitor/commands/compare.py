"""`torchtop compare A B [C...]`: recordings side by side, each against the first (text or JSON).

`--demo amp` records the mixed-precision demo in FP32 and under autocast, `--demo workers` the
data-bound demo with one DataLoader worker and with more, one after the other, then compares
them: the before/after a user would measure on their own run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchtop.monitor.diagnosis.report_types import RunReport

EXIT_USAGE = 2
DEMO_SECONDS = 20.0

#: demo pair -> [(name, demo module, its arguments)]; {amp}/{workers} are filled from the options
DEMOS: dict[str, list[tuple[str, str, list[str]]]] = {
    "amp": [
        ("fp32", "mixed_precision", ["--precision", "fp32"]),
        ("{amp}", "mixed_precision", ["--precision", "{amp}"]),
    ],
    "workers": [
        ("1-worker", "data_bound", ["--workers", "1"]),
        ("{workers}-workers", "data_bound", ["--workers", "{workers}"]),
    ],
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from torchtop.monitor.commands.args import seconds

    p.add_argument("paths", nargs="*", help="recordings (the first is the baseline)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument(
        "--seconds",
        type=seconds,
        default=None,
        help="compare each run's last S seconds (default: all past warm-up)",
    )
    p.add_argument(
        "--rank", type=int, default=None, help="a job's recording: which rank (default: the lowest)"
    )
    p.add_argument("--names", default=None, help="comma-separated names for the runs (default: their paths)")
    p.add_argument("--demo", choices=sorted(DEMOS), default=None, help="record a demo pair, then compare it")
    p.add_argument(
        "--device", default="auto", choices=["auto", "cpu", "cuda"], help="--demo: where it trains"
    )
    p.add_argument(
        "--demo-seconds", type=seconds, default=DEMO_SECONDS, help="--demo: seconds each run trains"
    )
    p.add_argument("--amp-dtype", default="bf16", choices=["bf16", "fp16"], help="--demo amp: autocast dtype")
    p.add_argument("--more-workers", type=int, default=None, help="--demo workers: the second run's workers")
    p.add_argument("--out", default=None, metavar="DIR", help="--demo: keep the recordings here")


def compare_report(path: str, seconds: float | None, rank: int | None) -> tuple[RunReport, list[str]]:
    """One recording's report: over its last `seconds`, or everything past warm-up."""
    from torchtop.monitor.diagnosis.facts import THRESHOLDS
    from torchtop.monitor.diagnosis.report import run_report
    from torchtop.monitor.model.playback import load

    playback, _ = load(path, rank)
    state = playback.state_until(None)
    if seconds is None:
        warm = int(THRESHOLDS.warmup_steps)
        first = next((s.t0 for s in state.steps if s.i >= warm and s.kind == "train"), None)
        window = state.agent_time - first + 1e-6 if first is not None else float("inf")
    else:
        window = seconds
    return run_report(state, window, path, window=window), playback.warnings


def run(args: argparse.Namespace) -> int:
    from torchtop.contract.recording import RecordingError
    from torchtop.monitor.model.compare import compare, render_text

    paths, names = list(args.paths), None
    if args.demo:
        if paths:
            return _usage("give recordings or --demo, not both")
        try:
            paths, names = record_demo_pair(args)
        except RuntimeError as exc:
            return _usage(str(exc), code=1)
    if len(paths) < 2:
        return _usage("compare needs two recordings or more (or --demo amp|workers)")
    if args.names:
        names = [n.strip() for n in args.names.split(",")]
        if len(names) != len(paths):
            return _usage(f"--names has {len(names)} names for {len(paths)} recordings")
    names = names or paths
    reports: list[RunReport] = []
    for path in paths:
        try:
            report, warnings = compare_report(path, args.seconds, args.rank)
        except RecordingError as exc:
            return _usage(str(exc))
        for line in warnings:
            print(f"torchtop: {line}", file=sys.stderr)
        reports.append(report)
    notes = []
    if args.demo == "amp" and args.amp_dtype == "bf16" and all(r.device == "cpu" for r in reports):
        if cpu_has_bf16() is False:
            notes.append(
                "this CPU has no bf16 instructions (neither avx512_bf16 nor amx_bf16 in /proc/cpuinfo): "
                "bf16 autocast runs emulated here, so it is slower than fp32 on this CPU, not in general"
            )
    result = compare(reports, names, notes, demo=bool(args.demo))
    print(json.dumps(result, indent=2) if args.json else render_text(result))
    return 0


def _usage(message: str, code: int = EXIT_USAGE) -> int:
    print(f"torchtop: {message}", file=sys.stderr)
    return code


def record_demo_pair(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """Run the pair one after the other, each recording itself; their paths and names."""
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix=f"torchtop-compare-{args.demo}-"))
    fill = {"amp": args.amp_dtype, "workers": str(args.more_workers or _more_workers())}
    paths, names = [], []
    for name, module, extra in DEMOS[args.demo]:
        name = name.format(**fill)
        path = out / name
        cmd = [sys.executable, "-m", f"torchtop.demos.{module}", "--device", args.device]
        cmd += ["--seconds", str(args.demo_seconds), "--log-every", "0", *(e.format(**fill) for e in extra)]
        env = dict(os.environ, TORCHTOP_RECORD=str(path), TORCHTOP_QUIET="1", PYTHONUNBUFFERED="1")
        print(
            f"torchtop compare: recording {name} ({' '.join(cmd[2:])}) into {path}",
            file=sys.stderr,
            flush=True,
        )
        proc = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
            raise RuntimeError(f"the {name} demo failed (exit {proc.returncode}): {tail[0]}")
        last = (proc.stdout.strip().splitlines() or [""])[-1]
        print(f"  {name}: {last}", file=sys.stderr, flush=True)
        paths.append(str(path))
        names.append(name)
    return paths, names


def _more_workers() -> int:
    """The second run of `--demo workers`: every CPU but the training process's own."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 2
    return max(2, min(8, cpus - 1))


def cpu_has_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool | None:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX-BF16); None: cannot tell."""
    try:
        with open(cpuinfo) as fh:
            for line in fh:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        return None
    return None
