"""What every demo scenario shares: arguments, device choice, a small CNN, the loop (data: data.py).

A scenario module builds its pieces from these (changing what it is about: a slow dataset, big
unpinned batches, a wide model, tiny kernels, leaked tensors...) and calls `run(main)`. The loop
is a plain PyTorch loop with no torchtop calls in it: the agent's zero-code hooks time it, as they
would a user's script.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from torch import nn
from torch.utils.data import DataLoader

EXIT_NO_DEVICE = 2
EXIT_NO_AGENT = 3
EXIT_INTERRUPTED = 130
#: Set by `torchtop demo`: the launcher finds the run by its discovery file, so one is required.
ENV_LAUNCHED = "TORCHTOP_DEMO_LAUNCHED"


class DemoError(Exception):
    """A one-line reason the demo cannot run, and its exit code."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


# -- arguments -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sizes:
    """A scenario's batch size, model width and loader workers on one kind of device.

    workers=None: `default_workers(cap)`, at most `cap` and one fewer than the CPUs.
    """

    batch_size: int
    width: int
    workers: int | None = None
    worker_cap: int = 2


#: On 2 CPU cores: a ~30 ms step, compute bound, data ~4%. On CUDA those sizes are launch bound
#: (a ~3 ms step keeping an H100 ~35% busy), so the GPU gets a wider model and bigger batches:
#: on an H100 with 16 CPUs that is an ~9 ms step, GPU ~100% busy, data wait ~2%.
CPU_SIZES = Sizes(batch_size=64, width=16, worker_cap=2)
CUDA_SIZES = Sizes(batch_size=256, width=256, worker_cap=6)


def build_parser(description: str | None) -> argparse.ArgumentParser:
    """The options every scenario takes; a scenario may add its own before parsing."""
    first_line = (description or "").strip().splitlines()[0] if description else None
    p = argparse.ArgumentParser(description=first_line)
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="where to train (auto: cuda if available)",
    )
    p.add_argument("--steps", type=int, default=None, help="stop after N steps (default: run until killed)")
    p.add_argument("--seconds", type=float, default=None, help="stop after S seconds")
    p.add_argument("--port", type=int, default=None, help="the agent's request port (default: a free one)")
    p.add_argument("--batch-size", type=int, default=None, help="default: the scenario's, per device")
    p.add_argument(
        "--width", type=int, default=None, help="channels of the first conv block (default: per device)"
    )
    p.add_argument(
        "--workers", type=int, default=None, help="DataLoader workers (default: per device and CPUs)"
    )
    p.add_argument("--log-every", type=int, default=50, help="print the loss every N steps (default 50)")
    p.add_argument("--seed", type=int, default=0)
    return p


def default_workers(cap: int = 2) -> int:
    """min(cap, CPUs - 1), at least 1: the training process keeps a core."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(cap, cpus - 1 if cpus > 2 else cpus))


def apply_sizes(args: argparse.Namespace, device: torch.device, cpu: Sizes, cuda: Sizes) -> None:
    """Fill --batch-size, --width and --workers the user left out from the device's sizes."""
    sizes = cuda if device.type == "cuda" else cpu
    if args.batch_size is None:
        args.batch_size = sizes.batch_size
    if args.width is None:
        args.width = sizes.width
    if args.workers is None:
        args.workers = sizes.workers if sizes.workers is not None else default_workers(sizes.worker_cap)


# -- setup ---------------------------------------------------------------------------------------
def pick_device(name: str) -> torch.device:
    """cpu, cuda, or auto (cuda when available); cuda without CUDA is a DemoError."""
    if name == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    if name == "auto":
        return torch.device("cpu")
    if torch.version.cuda is None:
        why = f"torch {torch.__version__} is a CPU-only build"
    else:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        why = f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU" + (
            f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        )
    raise DemoError(f"--device cuda: CUDA is not available ({why}); use --device cpu or auto", EXIT_NO_DEVICE)


def require_cuda(device_name: str, name: str, why: str) -> None:
    """For a scenario that only exists on a GPU: one line saying so (and what to try) when
    --device does not give it one."""
    if pick_device(device_name).type != "cuda":
        raise DemoError(f"{name} needs CUDA: {why}", EXIT_NO_DEVICE)


class StopFlag:
    """Set by SIGTERM (or the step/time limit) so the loop ends after the step it is in.

    A second SIGTERM raises SystemExit at once, in case a step never ends.
    """

    def __init__(self) -> None:
        self.event = threading.Event()

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.event.is_set():
            raise SystemExit(128 + signum)
        self.event.set()

    def __bool__(self) -> bool:
        return self.event.is_set()


def start_agent(port: int | None) -> Any:
    """Start torchtop's agent before anything else touches the model or the data."""
    import torchtop.agent

    agent = torchtop.agent.start(port=port)
    if agent is None:
        raise DemoError("the torchtop agent did not start (see the line above)", EXIT_NO_AGENT)
    if os.environ.get(ENV_LAUNCHED) and agent.discovery_file is None:
        raise DemoError("the agent could not write its discovery file (see above)", EXIT_NO_AGENT)
    return agent


def setup(
    args: argparse.Namespace, cpu: Sizes = CPU_SIZES, cuda: Sizes = CUDA_SIZES
) -> tuple[torch.device, StopFlag]:
    """Device (fails fast), sizes, seed, SIGTERM handling, then the agent."""
    device = pick_device(args.device)
    apply_sizes(args, device, cpu, cuda)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    stop = StopFlag()
    stop.install()
    start_agent(args.port)
    return device, stop


# -- model ---------------------------------------------------------------------------------------
def conv_block(c_in: int, c_out: int, pool: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = [
        nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
    ]
    if pool:
        layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers)


class SmallCNN(nn.Module):
    """Three conv-BN-ReLU-pool blocks and a linear head: 24 k parameters at width 16, 5.9 M at 256."""

    def __init__(self, num_classes: int = 10, width: int = 16, channels: int = 3) -> None:
        super().__init__()
        self.features = nn.Sequential(
            conv_block(channels, width),
            conv_block(width, 2 * width),
            conv_block(2 * width, 4 * width),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(4 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# -- the loop ------------------------------------------------------------------------------------
def to_device(batch: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = batch
    non_blocking = device.type == "cuda"
    return images.to(device, non_blocking=non_blocking), labels.to(device, non_blocking=non_blocking)


def train(
    model: nn.Module,
    loader: DataLoader,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    args: argparse.Namespace,
    stop: StopFlag,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    move: Callable[[Any, torch.device], tuple[torch.Tensor, torch.Tensor]] = to_device,
    after_step: Callable[[int, torch.Tensor], None] | None = None,
) -> int:
    """Train until --steps, --seconds or SIGTERM; print the loss every --log-every steps.

    `after_step(step, loss)` lets a scenario add its twist (keep tensors, allocate odd sizes...).
    Returns the exit code (0).
    """
    loss_fn = loss_fn or nn.CrossEntropyLoss()
    model.train()
    limit = RunLimit(args)
    step = 0
    log = LossLog(args.log_every, device)
    while not stop:
        for batch in loader:
            images, labels = move(batch, device)
            loss = loss_fn(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            log.add(step, loss)
            if after_step is not None:
                after_step(step, loss)
            if limit.reached(step):
                stop.event.set()
            if stop:
                break
    log.flush()
    limit.report(step, device)
    return 0


class RunLimit:
    """--steps and --seconds, and the closing line: steps, time, and the memory peak (the
    process's peak RSS; on CUDA also the allocator's peak), which `torchtop compare` checks."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.steps = args.steps
        self.started = time.perf_counter()
        self.deadline = None if args.seconds is None else time.monotonic() + args.seconds

    def reached(self, step: int) -> bool:
        return (self.steps is not None and step >= self.steps) or (
            self.deadline is not None and time.monotonic() >= self.deadline
        )

    def report(self, step: int, device: torch.device) -> None:
        elapsed = time.perf_counter() - self.started
        line = f"stopped after {step} steps in {elapsed:.1f} s ({step / elapsed:.2f} steps/s)"
        from torchtop.agent.telemetry.host import peak_rss

        if peak := peak_rss():
            line += f"; peak RSS {peak / 2**20:.0f} MiB"
        if device.type == "cuda":
            line += f"; CUDA peak allocated {torch.cuda.max_memory_allocated(device) / 2**20:.0f} MiB"
        print(line, flush=True)


class Progress:
    """Prints "step N  ms/step" every `every` steps, from the host's clock (no sync: a full
    launch queue paces the host, so this is the GPU's pace too)."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.last = time.monotonic()

    def step(self, n: int) -> None:
        if self.every > 0 and n % self.every == 0:
            now = time.monotonic()
            print(f"step {n:6d}  {(now - self.last) * 1000 / self.every:6.1f} ms/step", flush=True)
            self.last = now


class LossLog:
    """Prints the mean loss every `every` steps without making the host wait for the device.

    On CUDA the sum is copied to pinned memory behind an event and printed once the event has
    completed (a step or so later): a `.item()` here would stall the loop every `every` steps
    while the GPU drains the work queued ahead, and that wait would show up as step time.
    """

    def __init__(self, every: int, device: torch.device) -> None:
        self.every = every
        self.cuda = device.type == "cuda"
        self.running = torch.zeros((), device=device)
        self.host = torch.zeros((), pin_memory=self.cuda)
        self.event = torch.cuda.Event() if self.cuda else None
        self.pending: tuple[int, float] | None = None  # (step, ms per step) waiting for `host`
        self.window_start = time.perf_counter()

    def add(self, step: int, loss: torch.Tensor) -> None:
        if self.every <= 0:
            return
        self.running += loss.detach()
        if self.pending is not None and (self.event is None or self.event.query()):
            self._print()
        if step % self.every == 0:
            if self.pending is not None:  # the last one is still in flight: rare, wait for it
                self.flush()
            now = time.perf_counter()
            self.pending = (step, (now - self.window_start) * 1000 / self.every)
            self.window_start = now
            self.host.copy_(self.running, non_blocking=self.cuda)
            self.running.zero_()
            if self.event is not None:
                self.event.record()
            else:
                self._print()

    def flush(self) -> None:
        if self.pending is not None:
            if self.event is not None:
                self.event.synchronize()
            self._print()

    def _print(self) -> None:
        step, ms = self.pending  # type: ignore[misc]
        self.pending = None
        print(f"step {step:6d}  loss {float(self.host) / self.every:.4f}  {ms:6.1f} ms/step", flush=True)


def describe(name: str, model: nn.Module, loader: DataLoader, device: torch.device) -> None:
    print(
        f"{name} demo on {device.type}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
        + f": {type(model).__name__} {count_parameters(model) / 1e6:.2f} M params, batch {loader.batch_size}, "
        f"{loader.num_workers} loader workers, torch {torch.__version__}",
        flush=True,
    )


def run(main: Callable[[], int]) -> NoReturn:
    """Run a scenario's main: a DemoError is one line on stderr and its exit code."""
    try:
        code = main()
    except DemoError as exc:
        print(f"torchtop demo: {exc}", file=sys.stderr, flush=True)
        code = exc.code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        code = EXIT_INTERRUPTED
    sys.exit(code)
