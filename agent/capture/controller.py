"""On-demand captures: a torch.profiler trace of the next N steps, or a CUDA memory snapshot.

The agent thread validates a request and arms the controller; the training thread, at its next
step boundary, starts the profiler (it records only the thread that started it), steps it at each
boundary, and stops it after exactly N steps. Export and summaries run on a writer thread. The
client names no path: files go only under the agent's output directory ($TORCHTOP_DIR, else
./torchtop-captures), and only as files.py allows (a private directory, new 0600 files, never
through a link). One capture at a time; another request while one runs is told "busy".
"""

from __future__ import annotations

import gzip
import json
import os
import socket
import threading
import time
import warnings
from collections import deque
from typing import TYPE_CHECKING, Any

from torchtop.agent.capture import files
from torchtop.agent.contract.wire import CaptureInfo
from torchtop.agent.warn import warn

if TYPE_CHECKING:
    from torchtop.agent.cuda_use import CudaUse
    from torchtop.agent.hooks.probe import Probe

MAX_PROFILE_STEPS = 100
MAX_MEMORY_STEPS = 1000
MAX_MEMORY_SECONDS = 120.0
START_TIMEOUT_S = 60.0  # no step boundary in this long: the capture fails with a reason
# at_step: start where the run's step count reaches it (a job's ranks capture the same steps)
PROFILE_ARGS = {
    "steps": int,
    "with_stack": bool,
    "record_shapes": bool,
    "profile_memory": bool,
    "at_step": int,
}
MEMORY_ARGS = {"steps": int, "seconds": (int, float), "at_step": int}


class CaptureError(ValueError):
    """A request refused; the message is sent back to the client."""


def _check_args(args: dict[str, Any], allowed: dict[str, Any]) -> None:
    for key, value in args.items():
        if key not in allowed:
            raise CaptureError(f"unknown argument {key[:64]!r}; allowed: {', '.join(allowed)}")
        kind = allowed[key]
        if isinstance(value, bool) and kind is not bool:
            raise CaptureError(f"argument {key!r} must be a number, not a boolean")
        if not isinstance(value, kind):
            raise CaptureError(f"argument {key!r} has the wrong type ({type(value).__name__})")


class CaptureController:
    def __init__(self, cuda: CudaUse, probe: Probe) -> None:
        self.cuda = cuda
        self.torch = cuda.torch
        self.probe = probe
        self.wanted = files.wanted_dir()  # from the cwd at start; checked again at each request
        self._dest: files.Destination | None = None  # the verified directory of the current capture
        self._warned = ""  # the fallback note already said on stderr
        self.host = socket.gethostname()
        self.current: CaptureInfo | None = None
        self.done: deque[CaptureInfo] = deque(maxlen=20)
        self._ids = 0
        self._prof: Any = None
        self._lock = threading.Lock()
        self.rank: int | None = None  # a rank of a job: its files are named by it

    # -- agent thread: requests ----------------------------------------------------------------
    def request(self, cmd: str, args: dict[str, Any]) -> CaptureInfo:
        with self._lock:
            if self.current is not None and self.current.state in ("pending", "running", "writing"):
                c = self.current
                raise CaptureError(
                    f"busy: capture {c.id} ({c.kind}) is {c.state}, {c.steps_done}/{c.steps_total} steps"
                )
            info = self._validate(cmd, args)
            try:
                dest = files.open_destination(self.wanted)
            except files.CaptureDirError as exc:
                raise CaptureError(str(exc)) from None
            if dest.note and dest.note != self._warned:
                warn(dest.note)  # once per reason; every capture it applies to carries it too
                self._warned = dest.note
            self._dest, info.note = dest, dest.note  # the last capture closed its own
            self._ids += 1
            info.id, info.host, info.requested_at = self._ids, self.host, time.time()
            self._args = args
            self.current = info
            self.probe.on_step = self.on_boundary  # armed: the training thread starts it
            return info

    def _validate(self, cmd: str, args: dict[str, Any]) -> CaptureInfo:
        at = args.get("at_step", 0)
        if isinstance(at, int) and not isinstance(at, bool) and at < 0:
            raise CaptureError(f"at_step must be a step number (0 or more), got {at}")
        if cmd == "capture-profile":
            _check_args(args, PROFILE_ARGS)
            steps = args.get("steps", 5)
            if not 1 <= steps <= MAX_PROFILE_STEPS:
                raise CaptureError(f"steps must be in 1..{MAX_PROFILE_STEPS}, got {steps}")
            return CaptureInfo(id=0, kind="profile", state="pending", steps_total=steps)
        if cmd == "capture-memory":
            _check_args(args, MEMORY_ARGS)
            if not self._cuda():
                raise CaptureError("memory snapshots need CUDA; this run does not use it")
            if "steps" in args and "seconds" in args:
                raise CaptureError("give steps or seconds, not both")
            steps, seconds = args.get("steps", 0), float(args.get("seconds", 0.0))
            if "steps" in args and not 1 <= steps <= MAX_MEMORY_STEPS:
                raise CaptureError(f"steps must be in 1..{MAX_MEMORY_STEPS}, got {steps}")
            if "seconds" in args and not 0.1 <= seconds <= MAX_MEMORY_SECONDS:
                raise CaptureError(f"seconds must be in 0.1..{MAX_MEMORY_SECONDS:g}, got {seconds:g}")
            if not steps and not seconds:
                steps = 5
            return CaptureInfo(id=0, kind="memory", state="pending", steps_total=steps, seconds=seconds)
        raise CaptureError(f"unknown capture command {cmd!r}")

    def _cuda(self) -> bool:
        return self.cuda.initialised(fresh=True)

    def poll(self) -> None:
        """Agent thread, each tick: time limits (start timeout, memory capture by seconds)."""
        c = self.current
        if c is None:
            return
        now = time.time()
        if c.state == "pending" and now - c.requested_at > START_TIMEOUT_S:
            self.probe.on_step = None
            self._fail(
                c,
                f"no step boundary in {START_TIMEOUT_S:.0f} s: is the loop running? Steps end at "
                "optimizer.step() or torchtop.agent.step()",
            )
        elif c.kind == "memory" and c.state == "running" and c.seconds and now - c.started_at >= c.seconds:
            self.probe.on_step = None
            self._finish_memory(c)

    def status(self) -> list[CaptureInfo]:
        return list(self.done) + ([self.current] if self.current and self.current not in self.done else [])

    def close(self) -> None:
        """On agent stop: end a profiler or memory recording still running (never raises)."""
        self.probe.on_step = None
        c = self.current
        try:
            if self._prof is not None:
                self._prof.stop()
                self._prof = None
            if c is not None and c.kind == "memory" and c.state == "running":
                self.torch.cuda.memory._record_memory_history(enabled=None)
        except Exception:
            pass
        if c is not None and c.state in ("pending", "running"):
            self._fail(c, "the agent stopped before the capture finished")

    # -- training thread: at each step boundary while armed --------------------------------------
    def on_boundary(self) -> None:
        c = self.current
        if c is None:
            self.probe.on_step = None
            return
        with warnings.catch_warnings():  # the profiler's warnings are ours, not the run's
            warnings.simplefilter("ignore")
            self._on_boundary(c)

    def _on_boundary(self, c: CaptureInfo) -> None:
        try:
            if c.state == "pending":
                if self.probe.steps < self._args.get("at_step", 0):
                    return  # the step the job's ranks start at has not come yet
                self._start(c)
            elif c.state == "running":
                c.steps_done += 1
                if c.kind == "profile":
                    self._prof.step()
                if c.steps_total and c.steps_done >= c.steps_total:
                    self.probe.on_step = None
                    if c.kind == "profile":
                        self._prof.stop()
                        self._spawn(self._write_profile, c, self._prof)
                        self._prof = None
                    else:
                        self._finish_memory(c)
        except Exception as exc:
            self.probe.on_step = None
            self._fail(c, f"{type(exc).__name__}: {exc}")

    def _start(self, c: CaptureInfo) -> None:
        torch = self.torch
        c.started_at = time.time()
        c.start_step = self.probe.steps
        if c.kind == "profile":
            from torch.profiler import ProfilerActivity, profile, schedule

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self._cuda() else [])
            args = self._args
            with warnings.catch_warnings():  # "won't be using warmup": we start at a boundary on purpose
                warnings.simplefilter("ignore")
                self._prof = profile(
                    activities=activities,
                    schedule=schedule(wait=0, warmup=0, active=c.steps_total, repeat=1),
                    record_shapes=bool(args.get("record_shapes", False)),
                    profile_memory=bool(args.get("profile_memory", False)),
                    with_stack=bool(args.get("with_stack", False)),
                )
            self._prof.start()
        else:
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        c.state = "running"

    # -- writer thread -------------------------------------------------------------------------
    def _spawn(self, fn: Any, *args: Any) -> None:
        args[0].state = "writing"
        threading.Thread(target=fn, args=args, name="torchtop-capture", daemon=True).start()

    def _fail(self, c: CaptureInfo, error: str) -> None:
        self._close_dest()  # before the state says so: the next request may then open its own
        c.state, c.error, c.finished_at = "failed", error[:500], time.time()
        self.done.append(c)

    def _done(self, c: CaptureInfo) -> None:
        self._close_dest()
        c.state, c.finished_at = "done", time.time()
        self.done.append(c)

    def _close_dest(self) -> None:
        dest, self._dest = self._dest, None
        if dest is not None:
            dest.close()

    def _stem(self, c: CaptureInfo) -> str:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(c.started_at))
        rank = f"rank{self.rank}-" if self.rank is not None else ""
        return f"{c.kind}-{rank}{os.getpid()}-{stamp}-{c.id}"

    def _write_profile(self, c: CaptureInfo, prof: Any) -> None:
        from torchtop.agent.capture.trace_summary import summarize

        warnings.filterwarnings("ignore", module=r"torch\.profiler.*")  # export warns on our thread
        try:
            assert self._dest is not None
            path, events = files.export(
                self._dest, self._stem(c), ".pt.trace.json.gz", prof.export_chrome_trace, _trace_events
            )
            summary = summarize(events)
            summary |= _top_ops(prof)
            c.path, c.summary = str(path), summary
            self._done(c)
        except Exception as exc:
            self._fail(c, f"export failed: {type(exc).__name__}: {exc}")

    def _finish_memory(self, c: CaptureInfo) -> None:
        self._spawn(self._write_memory, c)

    def _write_memory(self, c: CaptureInfo) -> None:
        from torchtop.agent.capture.memory_summary import top_allocation_sites

        torch = self.torch
        try:
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            import pickle

            assert self._dest is not None
            path, fd = files.create(self._dest, self._stem(c), ".memory.pickle")
            with os.fdopen(fd, "wb") as fh:  # the format pytorch.org/memory_viz opens; never sent on the wire
                pickle.dump(snapshot, fh)
            c.path = str(path)
            c.summary = {
                "top_sites": top_allocation_sites(snapshot),
                "segments": len(snapshot.get("segments", [])),
            }
            self._done(c)
        except Exception as exc:
            try:
                torch.cuda.memory._record_memory_history(enabled=None)
            except Exception:
                pass
            self._fail(c, f"snapshot failed: {type(exc).__name__}: {exc}")


def _trace_events(path: str) -> list[dict[str, Any]]:
    with gzip.open(path, "rt") as fh:
        return json.load(fh).get("traceEvents", [])


def _top_ops(prof: Any, n: int = 10) -> dict[str, Any]:
    avgs = prof.key_averages()

    def row(a: Any, key: str) -> dict[str, Any]:
        return {"name": a.key, "calls": a.count, "self_ms": round(getattr(a, key, 0) / 1000.0, 4)}

    dev_key = (
        "self_device_time_total"
        if avgs and hasattr(avgs[0], "self_device_time_total")
        else "self_cuda_time_total"
    )
    by_cpu = sorted(avgs, key=lambda a: a.self_cpu_time_total, reverse=True)[:n]
    by_dev = [
        a
        for a in sorted(avgs, key=lambda a: getattr(a, dev_key, 0), reverse=True)
        if getattr(a, dev_key, 0) > 0
    ][:n]
    return {
        "top_cpu": [row(a, "self_cpu_time_total") for a in by_cpu],
        "top_device": [row(a, dev_key) for a in by_dev],
    }
