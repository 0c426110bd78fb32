"""On-demand captures: a torch.profiler trace of the next N steps, or a CUDA memory snapshot.

Three threads take part and one owns the record: the agent thread validates a request, arms the
training thread and publishes each `CaptureInfo` (a new frozen one at every change). The training
thread starts, steps and stops the profiler at step boundaries (it records only the thread that
started it); a writer thread exports the files. Both post what happened to the agent thread.
The client names no path: files go under $TORCHTOP_DIR (else ./torchtop-captures), and only as
files.py allows (a private directory, new 0600 files, never through a link).
"""

from __future__ import annotations

import gzip
import json
import os
import socket
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import msgspec

from torchtop.agent.capture import cupti, files
from torchtop.agent.capture.arguments import CaptureError, validate
from torchtop.agent.capture.memory_growth import Midpoint, record_history
from torchtop.agent.hooks.step_hooks import Order
from torchtop.agent.warn import ignore_warning, warn
from torchtop.contract.capture import (
    CAPTURE_ACTIVE,
    CaptureInfo,
    CaptureKind,
    CaptureState,
)

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import ModuleType

    from torch.profiler import profile as Profiler

    from torchtop.agent.cuda_use import CudaUse
    from torchtop.agent.hooks.probe import Probe

HOOK = "capture"  # its step-boundary hook (hooks/step_hooks.py)
START_TIMEOUT_S = 60.0  # no step boundary in this long: the capture fails with a reason
PENDING, RUNNING, WRITING = CaptureState.PENDING, CaptureState.RUNNING, CaptureState.WRITING
DONE, FAILED = CaptureState.DONE, CaptureState.FAILED


class _Run:
    """One armed capture as the training thread runs it. `over` is set once, by the thread that
    ends the run: the training thread after N steps, the agent thread on a start timeout (under
    the start lock) or when a memory capture's seconds are up. The other fields are the training
    thread's."""

    def __init__(self, info: CaptureInfo, options: dict[str, Any]) -> None:
        self.id, self.kind, self.steps = info.id, info.kind, info.steps_total
        self.options = options
        self.over = False
        self.started = False
        self.started_at = 0.0
        self.steps_done = 0
        self.at_step = int(options.get("at_step", 0))
        self.prof: Profiler | None = None
        self.cuda = False  # its profiler records CUDA activity (CUPTI attached)
        self.mark: tuple[int, float] = (
            0,
            0.0,
        )  # a memory capture's last step boundary: (steps done, time.time())
        self.first: Midpoint | None = None  # a memory capture's snapshot at its midpoint


class CaptureController:
    def __init__(self, cuda: CudaUse, probe: Probe) -> None:
        self.cuda = cuda
        self.torch: ModuleType = cuda.torch
        self.probe = probe
        self.wanted = files.wanted_dir()  # from the cwd at start; checked again at each request
        self._dest: files.Destination | None = None  # the current capture's verified directory
        self._warned = ""  # the fallback note already said on stderr
        self.host = socket.gethostname()
        # the agent thread's (close()'s once that thread has stopped): published, never mutated
        self.current: CaptureInfo | None = None
        self.done: deque[CaptureInfo] = deque(maxlen=20)
        self._ids = 0
        self._run: _Run | None = None  # handed to the training thread when armed
        self._news: deque[tuple[int, dict[str, Any]]] = deque()  # (id, changes) from the other threads
        self._start_lock = threading.Lock()  # a start and a timeout's cancel never cross
        self._deferred = False  # asked for while the step was another hook's (step_hooks.RULE): armed later
        self.rank: int | None = None  # a rank of a job: its files are named by it
        self.cupti_kept: str | None = None  # why the last profile left CUPTI attached ("" : it did not)

    # -- agent thread ----------------------------------------------------------------------------
    def request(self, cmd: str, args: dict[str, Any]) -> CaptureInfo:
        self._apply_news()
        c = self.current
        if c is not None and c.state in CAPTURE_ACTIVE:
            raise CaptureError(
                f"busy: capture {c.id} ({c.kind}) is {c.state}, {c.steps_done}/{c.steps_total} steps"
            )
        kind, steps, seconds = validate(cmd, args, self._cuda)
        try:
            dest = files.open_destination(self.wanted)
        except files.CaptureDirError as exc:
            raise CaptureError(str(exc)) from None
        if dest.note and dest.note != self._warned:
            warn(dest.note)  # once per reason; every capture it applies to carries it too
            self._warned = dest.note
        self._dest = dest  # the last capture's was closed when it finished
        self._ids += 1
        info = CaptureInfo(
            id=self._ids,
            kind=kind,
            state=PENDING,
            steps_total=steps,
            seconds=seconds,
            host=self.host,
            note=dest.note,
            requested_at=time.time(),
        )
        self.current = info
        self._run = _Run(info, args)
        # armed: the training thread starts it at a boundary; while the FLOP count's step is open
        # the rule says wait, and poll() arms it once that step has ended
        self._deferred = not self._arm()
        return info

    def _arm(self) -> bool:
        return self.probe.hooks.register(HOOK, self.on_boundary, Order.CAPTURE)

    def _disarm(self) -> None:
        self.probe.hooks.unregister(HOOK, self.on_boundary)

    def _cuda(self) -> bool:
        return self.cuda.initialised(fresh=True)

    def poll(self) -> None:
        """Agent thread, each tick: publish the other threads' news, then the time limits."""
        self._apply_news()
        c, run = self.current, self._run
        if c is None or run is None or run.over:
            return
        if self._deferred and self._arm():
            self._deferred = False
        now = time.time()
        if c.state == PENDING and now - c.requested_at > START_TIMEOUT_S:
            with self._start_lock:
                if run.started:  # it started meanwhile: its news comes next tick
                    return
                run.over = True
                self._disarm()  # a deferred capture holds nothing: a no-op
                self._deferred = False
            self._publish(
                c.id,
                state=FAILED,
                error=f"no step boundary in {START_TIMEOUT_S:.0f} s: is the loop running? Steps end at "
                "optimizer.step() or torchtop.agent.step()",
            )
        elif (
            c.kind == CaptureKind.MEMORY
            and c.state == RUNNING
            and c.seconds
            and now - c.started_at >= c.seconds
        ):
            run.over = True
            self._disarm()
            self._publish(c.id, state=WRITING)
            self._spawn(self._write_memory, c.id, c.kind, c.started_at, self._dest, run)
        elif c.kind == CaptureKind.MEMORY and c.state == RUNNING and c.seconds and run.first is None:
            if now - c.started_at >= c.seconds / 2:  # a timed capture's midpoint: cut at its last boundary
                run.first = Midpoint(self.torch.cuda.memory._snapshot, *run.mark)

    def status(self) -> list[CaptureInfo]:
        self._apply_news()
        listed = list(self.done)
        if self.current is not None and all(c.id != self.current.id for c in listed):
            listed.append(self.current)
        return listed

    def _apply_news(self) -> None:
        news = self._news
        while news:
            cid, changes = news.popleft()
            self._publish(cid, **changes)

    def _publish(self, cid: int, **changes: Any) -> None:
        """The one place a capture's record changes: a new frozen CaptureInfo replaces the old."""
        c = self.current
        if c is None or c.id != cid or c.state not in CAPTURE_ACTIVE:
            return  # news of a capture already failed (a timeout) or replaced
        if "error" in changes:
            changes["error"] = changes["error"][:500]
        c = msgspec.structs.replace(c, **changes)
        if c.state not in CAPTURE_ACTIVE:
            self._close_dest()  # before the state says so: the next request may open its own
            c = msgspec.structs.replace(c, finished_at=time.time())
            self.done.append(c)
        self.current = c

    def _close_dest(self) -> None:
        dest, self._dest = self._dest, None
        if dest is not None:
            dest.close()

    def close(self) -> None:
        """On agent stop, once the agent thread has stopped (this thread owns the record now):
        end a profiler or memory recording still running. Never raises."""
        self._disarm()
        run = self._run
        if run is not None and run.started and not run.over:
            try:
                if run.prof is not None:
                    run.prof.stop()
                elif run.kind == CaptureKind.MEMORY:
                    self.torch.cuda.memory._record_memory_history(enabled=None)
            except Exception:  # broad: best-effort stop of a capture left running
                pass
        self._apply_news()
        c = self.current
        if c is not None and c.state in (PENDING, RUNNING):
            self._publish(c.id, state=FAILED, error="the agent stopped before the capture finished")

    # -- training thread: at each step boundary while armed ------------------------------------
    def on_boundary(self) -> None:
        run = self._run
        if run is None or run.over:
            self._disarm()
            return
        try:
            if not run.started:
                if self.probe.steps >= run.at_step:  # else the step the job's ranks start at is ahead
                    self._start(run)
                return
            run.steps_done += 1
            last = bool(run.steps) and run.steps_done >= run.steps
            if run.kind == CaptureKind.MEMORY:
                run.mark = (run.steps_done, time.time())
                if not last and run.steps_done == run.steps // 2:  # its first snapshot, on its own thread
                    run.first = Midpoint(self.torch.cuda.memory._snapshot, *run.mark)
            if run.prof is not None and not last:
                run.prof.step()
            self._news.append((run.id, {"steps_done": run.steps_done}))
            if last:
                self._disarm()
                run.over = True
                dest = self._dest  # set before arming; closed only once the capture has finished
                if run.prof is not None:
                    prof, run.prof = run.prof, None
                    # its last step stops the trace: CUPTI's teardown is decided there
                    self.cupti_kept = cupti.stop(prof, self.torch, run.cuda, last_step=True)
                    self._news.append((run.id, {"state": WRITING}))
                    self._spawn(self._write_profile, run.id, run.kind, run.started_at, dest, prof)
                else:
                    self._news.append((run.id, {"state": WRITING}))
                    self._spawn(self._write_memory, run.id, run.kind, run.started_at, dest, run)
        except Exception as exc:  # broad: a capture's failure is reported, never raised into training
            self._disarm()
            run.over = True
            prof, run.prof = run.prof, None
            try:
                if prof is not None:
                    prof.stop()  # a profiler left running would slow every step after
                elif run.kind == CaptureKind.MEMORY and run.started:
                    self.torch.cuda.memory._record_memory_history(enabled=None)  # so would history
            except Exception:  # broad: best-effort stop of the failed capture's profiler or history
                pass
            self._news.append((run.id, {"state": FAILED, "error": f"{type(exc).__name__}: {exc}"}))

    def _start(self, run: _Run) -> None:
        with self._start_lock:  # once a capture: cheap, and a timeout cannot cancel it half-started
            if run.over or not self.probe.hooks.open(HOOK, self.on_boundary):
                return  # timed out, or no longer registered
            run.started_at = started_at = time.time()
            if run.kind == CaptureKind.PROFILE:
                run.prof = self._profiler(run)
                run.prof.start()
            else:
                record_history(self.torch.cuda.memory)
                run.mark = (0, started_at)
            run.started = True
        self._news.append(
            (run.id, {"state": RUNNING, "started_at": started_at, "start_step": self.probe.steps})
        )

    def _profiler(self, run: _Run) -> Profiler:
        from torch.profiler import ProfilerAction, ProfilerActivity, profile

        def record(step: int) -> ProfilerAction:  # schedule(warmup=0, active=N) without its warning
            if step < run.steps - 1:
                return ProfilerAction.RECORD
            return ProfilerAction.RECORD_AND_SAVE if step == run.steps - 1 else ProfilerAction.NONE

        options = run.options
        run.cuda = self._cuda()
        return profile(
            activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if run.cuda else []),
            schedule=record,  # a schedule also marks each step (ProfilerStep#N) in the trace
            record_shapes=bool(options.get("record_shapes", False)),
            profile_memory=bool(options.get("profile_memory", False)),
            with_stack=bool(options.get("with_stack", False)),
        )

    # -- writer thread: posts its outcome --------------------------------------------------------
    def _spawn(self, fn: Callable[..., None], *args: Any) -> None:
        threading.Thread(target=fn, args=args, name="torchtop-capture", daemon=True).start()

    def _stem(self, cid: int, kind: CaptureKind, started_at: float) -> str:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(started_at))
        rank = f"rank{self.rank}-" if self.rank is not None else ""
        return f"{kind}-{rank}{os.getpid()}-{stamp}-{cid}"

    def _write_profile(
        self, cid: int, kind: CaptureKind, started_at: float, dest: files.Destination | None, prof: Profiler
    ) -> None:
        from torchtop.agent.capture.trace_summary import summarize

        quiet = ignore_warning(module=r"torch\.(autograd\.)?profiler")  # its export warns on this thread
        try:
            assert dest is not None
            stem = self._stem(cid, kind, started_at)
            path, events = files.export(
                dest, stem, ".pt.trace.json.gz", prof.export_chrome_trace, _trace_events
            )
            summary = summarize(events) | _top_ops(prof)
            self._news.append((cid, {"state": DONE, "path": str(path), "summary": summary}))
        except Exception as exc:  # broad: any export failure is the capture's error, not the writer's end
            self._news.append(
                (cid, {"state": FAILED, "error": f"export failed: {type(exc).__name__}: {exc}"})
            )
        finally:
            quiet()

    def _write_memory(
        self, cid: int, kind: CaptureKind, started_at: float, dest: files.Destination | None, run: _Run
    ) -> None:
        from torchtop.agent.capture.memory_summary import top_allocation_sites

        torch = self.torch
        try:
            if run.first is not None:
                run.first.wait()  # the two snapshots never at once
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            import pickle

            assert dest is not None
            path, fd = files.create(dest, self._stem(cid, kind, started_at), ".memory.pickle")
            with os.fdopen(fd, "wb") as fh:  # the format pytorch.org/memory_viz opens; never sent on the wire
                pickle.dump(snapshot, fh)
            summary = {
                "top_sites": top_allocation_sites(snapshot),
                "segments": len(snapshot.get("segments", [])),
            }
            if run.first is not None:
                summary |= run.first.summary(snapshot, *run.mark)
            self._news.append((cid, {"state": DONE, "path": str(path), "summary": summary}))
        except Exception as exc:  # broad: any snapshot failure is the capture's error, not the writer's end
            try:
                torch.cuda.memory._record_memory_history(enabled=None)
            except Exception:  # broad: best-effort: allocator history off
                pass
            self._news.append(
                (cid, {"state": FAILED, "error": f"snapshot failed: {type(exc).__name__}: {exc}"})
            )


def _trace_events(path: str) -> list[dict[str, Any]]:
    with gzip.open(path, "rt") as fh:
        return json.load(fh).get("traceEvents", [])


def _top_ops(prof: Profiler, n: int = 10) -> dict[str, Any]:
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
