"""What holds the run back, in plain words with the numbers: pure functions of `Facts`.

One primary verdict (`data-loading`, `transfer`, `outside-phases`, `host-overhead`, else
`compute`; `unknown` with too few steps) with a severity; the independent flags are in flags.py.
`compute` is the healthy headline: it never stands where the model's work is a small share of
the step, and data or transfer waits under 20% are notes in its evidence, not a headline of
their own. `sync` and `host-code` (why.py) say where the step waits on the device or runs user
code, and `refine` turns `outside-phases` into `host-code` where stack samples name the code.
A monitor follows one rank, so there is no straggler flag. Thresholds (and the public
rules they start from: README, "What the verdict means") are in facts.THRESHOLDS. The verdict in
force is re-judged with its thresholds x0.8 (hysteresis), so it does not flap on noise.
"""

from __future__ import annotations

from torchtop.monitor.diagnosis.facts import THRESHOLDS as T
from torchtop.monitor.diagnosis.facts import Facts, Finding, Severity, worker_busy
from torchtop.monitor.model.fmt import pct

COMPUTE = ("forward", "backward", "optimizer")


def _band(share: float, scale: float = 1.0) -> Severity | None:
    if share >= T.input_severe * scale:
        return "critical"
    if share >= T.input_high * scale:
        return "warning"
    return None


def compute_share(f: Facts) -> float:
    """forward+backward+optimizer's share of the host's step time."""
    return sum(f.shares.get(k, 0.0) for k in COMPUTE)


def device_compute_ms(f: Facts) -> float:
    """CUDA-event ms of forward+backward+optimizer a sampled step (0: not known)."""
    return sum(f.device_ms.get(k, 0.0) for k in COMPUTE)


def gpu_busy(f: Facts) -> bool | None:
    """On CUDA: is the GPU busy for most of the step (so the host's time outside the measured
    phases is mostly it waiting on the GPU: a .item(), a .cpu(), a synchronize)? From CUDA-event
    times where steps were sampled, or NVML utilisation; None on CPU or when neither is known."""
    if f.device != "cuda":
        return None
    dev = device_compute_ms(f)
    known = False
    if dev > 0 and f.step_ms > 0:
        known = True
        if dev / f.step_ms >= T.gpu_busy:
            return True
    if f.gpu_util is not None:
        known = True
        if f.gpu_util >= T.gpu_util_low:
            return True
    return False if known else None


def outside_dominates(f: Facts, scale: float = 1.0) -> bool:
    """Time outside the measured phases is at least `outside_high` of the step and more than the
    model's own work, on a host that is not just waiting on a busy GPU."""
    other = f.shares.get("other", 0.0)
    if other < T.outside_high * scale or other <= compute_share(f):
        return False
    return f.device != "cuda" or gpu_busy(f) is False


def notes(f: Facts) -> list[str]:
    """Small data and transfer waits, as lines under a headline that is not about them."""
    out: list[str] = []
    for key, words in (("data", "data wait"), ("h2d", "host-to-device copies")):
        share = f.shares.get(key, 0.0)
        if share >= T.input_moderate:
            out.append(
                f"note: {words} {pct(share, 0)} of step time ({f.ms.get(key, 0):.1f} ms a step): "
                "small, not what holds the run back"
            )
    return out


def worker_saturated(f: Facts) -> bool:
    """The DataLoader workers never rest: on a CPU, or waiting for one, most of the time."""
    busy = worker_busy(f.worker_cpu, f.worker_wait)
    return bool(f.workers) and busy is not None and busy >= T.worker_saturated


def _loader_advice(f: Facts) -> str | None:
    """More DataLoader workers, where that is the fix: none (or unknown), or saturated ones with
    idle cores, and enough loading a step to be worth a hand-over between processes."""
    if f.ms.get("data", 0.0) < T.workers_min_ms:
        return None
    if not f.workers:
        return f"load in worker processes: DataLoader(num_workers={max(2, f.cores - 1)}, persistent_workers=True)"
    starved = f.worker_wait is not None and f.worker_wait >= T.worker_cpu_starved
    if f.workers and worker_saturated(f) and f.cores > f.workers + 1 and not starved:
        return f"raise DataLoader num_workers from {f.workers} toward {f.cores - 1} (cores are free)"
    return None


# -- primary verdict rules -----------------------------------------------------------------------
def rule_data(f: Facts, scale: float = 1.0) -> Finding | None:
    share = f.shares.get("data", 0.0)
    if _band(share, scale) is None:
        return None
    severity = _band(share) or "warning"  # hysteresis keeps the verdict; it does not raise the severity
    evidence = [
        f"data wait is {pct(share, 0)} of step time: {f.ms.get('data', 0):.1f} ms of {f.step_ms:.1f} ms"
    ]
    if f.workers == 0:
        evidence.append("no DataLoader worker processes: loading runs on the training process")
    elif f.workers and f.worker_cpu is not None:
        evidence.append(f"{_workers(f.workers, f.worker_cpu, f.worker_wait)} on average ({f.cores} cores)")
    advice: list[str] = []
    more = _loader_advice(f)
    if more:
        advice.append(more)
    advice.append("make per-sample work cheaper: precompute/cache decoded data, move augmentation to the GPU")
    advice.append("pin_memory=True and a larger prefetch_factor smooth out uneven batches")
    return Finding("data-loading", severity, share, tuple(evidence), tuple(advice[:3]))


def _workers(n: int, cpu: float, wait: float | None) -> str:
    line = f"{n} DataLoader worker{'' if n == 1 else 's'} at {cpu:.0f}% CPU"
    if wait is not None:
        line += f", {wait:.0f}% waiting for a CPU"
    return line


def rule_transfer(f: Facts, scale: float = 1.0) -> Finding | None:
    host = f.shares.get("h2d", 0.0)
    dev_step = f.device_ms.get("step", 0.0)
    dev = f.device_ms.get("h2d", 0.0) / dev_step if dev_step > 0 else 0.0
    share = max(host, dev)
    if _band(share, scale) is None:
        return None
    severity = _band(share) or "warning"  # hysteresis keeps the verdict; it does not raise the severity
    evidence = [
        f"host-to-device copies take {pct(host, 0)} of step time ({f.ms.get('h2d', 0):.1f} ms of {f.step_ms:.1f} ms)"
    ]
    if dev > 0:
        evidence.append(
            f"on the GPU the copies take {pct(dev, 0)} of the step ({f.device_ms.get('h2d', 0):.1f} ms)"
        )
    advice = (
        "DataLoader(pin_memory=True) and .to(device, non_blocking=True): pinned copies overlap compute",
        "send compact dtypes (uint8 images, int32 tokens) and convert on the GPU",
        "keep static data on the GPU instead of copying it every step",
    )
    return Finding("transfer", severity, share, tuple(evidence), advice)


def rule_outside(f: Facts, scale: float = 1.0) -> Finding | None:
    """Most of the step is spent outside data/h2d/forward/backward/optimizer: an input that is
    not a DataLoader (a generator doing the preprocessing), per-step host work (logging,
    metrics, checkpoints), or model code torchtop does not see. Never on a busy GPU's host.
    A finer rule (stack samples saying where `other` goes) refines it where `outside_dominates`."""
    if not outside_dominates(f, scale):
        return None
    other = f.shares.get("other", 0.0)
    if f.checkpoint is not None and f.checkpoint.extra_share >= 0.5 * other:
        return None  # most of it is the steps a save slows after it: the checkpoint verdict's
    severity = "critical" if other >= T.outside_severe else "warning"
    compute = compute_share(f)
    evidence = [
        f"{pct(other, 0)} of step time is outside the measured phases: "
        f"{f.ms.get('other', 0):.1f} ms of {f.step_ms:.1f} ms",
        f"forward+backward+optimizer are only {pct(compute, 0)} of it "
        f"({sum(f.ms.get(k, 0.0) for k in COMPUTE):.1f} ms a step)",
    ]
    untimed_input = f.ms.get("data", 0.0) == 0 and not f.workers
    if untimed_input:
        evidence.append(
            "no data wait was measured: the loop's input (a generator? an iterator?) is not timed"
        )
    if f.device == "cuda" and f.gpu_util is not None:
        evidence.append(f"GPU busy only {f.gpu_util:.0f}% of the time (NVML)")
    evidence += notes(f)
    advice: list[str] = []
    if untimed_input:
        advice.append(
            "wrap the input: `for batch in torchtop.agent.data(batches):` times it as data wait, "
            "and the verdict then says what to do about it"
        )
    advice.append(
        "look for per-step host work in the loop: preprocessing, logging, metrics, .item(), checkpoints"
    )
    advice.append(
        'time a suspect block with `with torchtop.agent.phase("data"):`, or profile the '
        "process (py-spy top --pid PID) to see where it goes"
    )
    return Finding("outside-phases", severity, other, tuple(evidence), tuple(advice[:3]))


def rule_host_overhead(f: Facts, scale: float = 1.0) -> Finding | None:
    if f.device != "cuda" or f.gpu_util is None:
        return None
    if f.shares.get("data", 0.0) >= T.input_moderate or f.shares.get("h2d", 0.0) >= T.input_moderate:
        return None
    if f.shares.get("other", 0.0) >= T.input_high:
        # the host's time is outside the phases that launch kernels: not launch overhead (where it
        # dominates, rule_outside says so; host-code names it where stack samples do)
        return None
    if f.checkpoint is not None and f.checkpoint.cost_share >= T.checkpoint_high:
        return None  # the GPU idles while the host saves: the checkpoint verdict's, not launches'
    low = T.gpu_util_low / scale if scale < 1 else T.gpu_util_low
    if f.gpu_util >= low:
        return None
    severity = "critical" if f.gpu_util < T.gpu_util_very_low else "warning"
    evidence = [f"GPU busy {f.gpu_util:.0f}% of the time (NVML) with no data or transfer wait"]
    if f.proc_cpu is not None:
        evidence.append(
            f"the training process uses {f.proc_cpu:.0f}% CPU: Python and kernel launches set the pace"
        )
    advice = (
        "torch.compile(model) (mode='reduce-overhead' adds CUDA graphs) fuses the many small kernels",
        "a larger batch size gives each launch more work",
        "avoid per-step host syncs (.item(), .cpu(), printing tensors) inside the loop",
    )
    return Finding("host-overhead", severity, 1.0 - f.gpu_util / 100.0, tuple(evidence), advice)


def rule_compute(f: Facts, scale: float = 1.0) -> Finding:
    """The healthy headline: the model's own work fills the step (on CUDA: keeps the GPU busy)."""
    share = compute_share(f)
    if f.inference:  # forward passes: no backward, no optimizer to name
        evidence = [f"the forward is {pct(share, 0)} of each pass ({f.step_ms:.1f} ms a pass)"]
    else:
        evidence = [
            f"forward+backward+optimizer are {pct(share, 0)} of step time ({f.step_ms:.1f} ms a step)"
        ]
    busy = gpu_busy(f)
    dev = device_compute_ms(f)
    if f.device == "cuda":
        if dev > 0 and f.step_ms > 0:
            evidence.append(f"on the GPU they take {dev:.1f} ms a step ({pct(min(1.0, dev / f.step_ms), 0)})")
            share = max(share, min(1.0, dev / f.step_ms)) if busy else share
        if f.gpu_util is not None:
            evidence.append(f"GPU busy {f.gpu_util:.0f}% of the time (NVML)")
    other = f.shares.get("other", 0.0)
    if other >= T.input_high:
        if busy:
            evidence.append(
                f"{pct(other, 0)} of the host's step is outside the measured phases, where it waits on the "
                "busy GPU (a .item(), .cpu() or synchronize): the GPU sets the pace"
            )
        else:
            evidence.append(
                f"{pct(other, 0)} of the step is outside the measured phases (logging, metrics, checkpoints?)"
            )
    evidence += notes(f)
    if f.inference:  # an eval or serving loop: nothing to fuse in an optimizer, nothing to train
        advice = (
            "torch.inference_mode() around the loop, and torch.compile(model)",
            "bfloat16 autocast (or a quantised model) and the largest batch the latency allows",
            *(() if f.device == "cuda" else ("run it on a GPU if one is available",)),
        )
    elif f.device == "cuda":
        advice = (
            "mixed precision: torch.autocast('cuda', dtype=torch.bfloat16)",
            "torch.compile(model)",
            "a fused optimizer (AdamW(fused=True)) and the largest batch that fits",
        )
    else:
        advice = (
            "torch.compile(model) and bfloat16 autocast on CPUs that support it",
            "set torch.set_num_threads() to the physical cores",
            "train on a GPU if one is available",
        )
    return Finding("compute", "ok", share, tuple(evidence), advice)
