"""Where a rank's exposed collective wait sits, from a torch.profiler trace kept by job_nccl.py --keep.

    python tests/gpu/exposed_where.py DIR

For each rank's trace: the compute stream (the stream with the most kernel time) and its idle gaps
while an NCCL kernel runs. Each gap is named by the innermost `FSDP::` / `nccl:` / module range on
the launching thread around the launch of the kernel that ends the gap (what the stream waited to
run), and by the last `cudaStreamWaitEvent` before that launch (who made it wait). Beside it,
torchtop's device `comm` for the same steps (rank*.torchtop.json). A diagnostic, not a test.
"""

from __future__ import annotations

import gzip
import json
import sys
from bisect import bisect_right
from collections import defaultdict
from pathlib import Path
from typing import Any


def _x(events: list[dict[str, Any]], *cats: str) -> list[dict[str, Any]]:
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in cats]


def _overlap(a0: float, a1: float, spans: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(a1, t) - max(a0, s)) for s, t in spans)


def analyse(trace: Path) -> None:
    with gzip.open(trace, "rt") as fh:
        events = json.load(fh)["traceEvents"]
    kernels = _x(events, "kernel", "gpu_memcpy", "gpu_memset")
    busy: dict[Any, float] = defaultdict(float)
    for k in kernels:
        if "nccl" not in str(k.get("name", "")).lower():
            busy[k["args"].get("stream")] += float(k["dur"])
    compute = max(busy, key=lambda s: busy[s])
    comp = sorted((k for k in kernels if k["args"].get("stream") == compute), key=lambda k: float(k["ts"]))
    nccl = sorted(
        (float(k["ts"]), float(k["ts"]) + float(k["dur"]), k["args"].get("stream"), k["name"])
        for k in kernels
        if "nccl" in str(k.get("name", "")).lower()
    )
    nccl_spans = [(s, t) for s, t, _, _ in nccl]
    runtime = {
        e["args"]["correlation"]: e
        for e in _x(events, "cuda_runtime", "cuda_driver")
        if "correlation" in e.get("args", {})
    }
    waits = sorted(
        (float(e["ts"]), e)
        for e in _x(events, "cuda_runtime", "cuda_driver")
        if "StreamWaitEvent" in e["name"]
    )
    wait_ts = [w[0] for w in waits]
    labels = [
        e
        for e in _x(events, "user_annotation", "cpu_op")
        if str(e["name"]).startswith(("FSDP::", "nccl:", "c10d::", "ProfilerStep", "_wait", "aten::copy_"))
        or "wait" in str(e["name"]).lower()
    ]

    def enclosing(ts: float, tid: Any) -> str:
        best = None
        for e in labels:
            if e.get("tid") != tid or not (float(e["ts"]) <= ts <= float(e["ts"]) + float(e["dur"])):
                continue
            if str(e["name"]).startswith("ProfilerStep"):
                continue
            if best is None or float(e["dur"]) < float(best["dur"]):
                best = e
        return best["name"] if best is not None else "(none)"

    by_label: dict[str, float] = defaultdict(float)
    by_waiter: dict[str, float] = defaultdict(float)
    gaps = 0
    total = 0.0
    for prev, nxt in zip(comp, comp[1:]):
        g0, g1 = float(prev["ts"]) + float(prev["dur"]), float(nxt["ts"])
        if g1 - g0 < 5:
            continue
        held = _overlap(g0, g1, nccl_spans)
        if held < 5:
            continue
        launch = runtime.get(nxt["args"].get("correlation"))
        tid = launch.get("tid") if launch else None
        where = enclosing(float(launch["ts"]), tid) if launch else "(no launch)"
        i = bisect_right(wait_ts, float(launch["ts"])) - 1 if launch else -1
        waiter = enclosing(wait_ts[i], waits[i][1].get("tid")) if i >= 0 else "(none)"
        by_label[where] += held
        by_waiter[waiter] += held
        gaps += 1
        total += held
    steps = [e for e in _x(events, "user_annotation", "cpu_op") if str(e["name"]).startswith("ProfilerStep#")]
    n = max(1, len({e["name"] for e in steps}))
    print(
        f"{trace.name}: compute stream {compute}; {gaps} gaps held by NCCL, {total / 1000 / n:.2f} ms a step"
    )
    print("  by the range that launched the kernel after the gap (ms a step):")
    for k, v in sorted(by_label.items(), key=lambda kv: -kv[1])[:12]:
        print(f"    {v / 1000 / n:8.3f}  {k}")
    print("  by the range of the last cudaStreamWaitEvent before it (ms a step):")
    for k, v in sorted(by_waiter.items(), key=lambda kv: -kv[1])[:12]:
        print(f"    {v / 1000 / n:8.3f}  {k}")
    by_stream: dict[Any, float] = defaultdict(float)
    for s, t, stream, _name in nccl:
        by_stream[stream] += t - s
    print(
        "  NCCL kernel time by stream (ms a step):", {k: round(v / 1000 / n, 3) for k, v in by_stream.items()}
    )


def main() -> int:
    folder = Path(sys.argv[1])
    for trace in sorted(folder.glob("rank*.pt.trace.json.gz")):
        analyse(trace)
        ours = folder / trace.name.replace(".pt.trace.json.gz", ".torchtop.json")
        if ours.exists():
            data = json.loads(ours.read_text())
            steps = list(data["steps"].values())
            if steps:
                keys = sorted({k for s in steps for k in s})
                mean = {k: round(sum(s.get(k, 0.0) for s in steps) / len(steps), 3) for k in keys}
                print(f"  torchtop device ms a step over {len(steps)} steps: {mean}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
