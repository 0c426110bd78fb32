"""Host code: most of each step goes to Python-side metrics and logging between the phases.

    python -m torchtop.demos.host_code [--device auto|cpu|cuda] [--steps N] [--seconds S]

After every optimizer step the loop computes running statistics over a long history of
per-sample records in plain Python and appends a JSON line to a log file: the usual
`log_metrics()` that started small. Forward, backward and the optimizer are a minority of the
step. torchtop should say host-code and name `log_metrics` in this file (its stack samples find
the training thread there), with what moving it off the step would buy.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections import deque

import torch
from torch import nn

from torchtop.demos import common, data

CPU = common.Sizes(batch_size=32, width=8, worker_cap=1)
CUDA = common.Sizes(batch_size=256, width=128, worker_cap=4)


class MetricsLog:
    """Per-sample records of the last `history` samples and a JSON line per step."""

    def __init__(self, history: int) -> None:
        # as after a while of training: the history is full from the first step
        self.records: deque[tuple[int, int, float]] = deque(
            ((0, i % 10, 1.0) for i in range(history)), maxlen=history
        )
        self.out = tempfile.TemporaryFile("w+", encoding="utf-8", prefix="torchtop-host-code-")  # noqa: SIM115
        self.last = time.perf_counter()

    def log_metrics(self, step: int, labels: list[int]) -> None:
        now = time.perf_counter()
        ms = (now - self.last) * 1e3
        self.last = now
        for label in labels:
            self.records.append((step, label, ms))
        per_class: dict[int, list[float]] = {}
        for _, label, t in self.records:
            per_class.setdefault(label, []).append(t)
        summary = {}
        for c, v in sorted(per_class.items()):
            mean = statistics.fmean(v)
            summary[str(c)] = {
                "n": len(v),
                "mean": mean,
                "sd": (sum((t - mean) ** 2 for t in v) / len(v)) ** 0.5,
            }
        self.out.write(json.dumps({"step": step, "ms": ms, "classes": summary}) + "\n")
        self.out.flush()


def main(argv: list[str] | None = None) -> int:
    p = common.build_parser(__doc__)
    p.add_argument("--history", type=int, default=None, help="per-sample records kept (default: per device)")
    args = p.parse_args(argv)
    device, stop = common.setup(args, CPU, CUDA)
    history = args.history or 300_000
    if device.type == "cpu":
        torch.set_num_threads(1)  # a small model: more threads only fight over a shared machine
    dataset = data.SyntheticImages(seed=args.seed)
    loader = data.make_loader(dataset, args.batch_size, args.workers, device, prefetch_factor=4)
    model = common.SmallCNN(num_classes=dataset.num_classes, width=args.width).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    metrics = MetricsLog(history)
    common.describe("host-code", model, loader, device)
    loss_fn = nn.CrossEntropyLoss()
    deadline = None if args.seconds is None else time.monotonic() + args.seconds
    step = 0
    progress = common.Progress(args.log_every)
    while not stop:
        for images, labels in loader:
            x, y = common.to_device((images, labels), device)
            loss = loss_fn(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            metrics.log_metrics(step, labels.tolist())  # the labels are still on the host
            progress.step(step)
            if (args.steps is not None and step >= args.steps) or (deadline and time.monotonic() >= deadline):
                stop.event.set()
            if stop:
                break
    print(f"stopped after {step} steps", flush=True)
    return 0


if __name__ == "__main__":
    common.run(main)
