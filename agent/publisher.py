"""The agent's own thread: everything that must not run on the training thread.

At a fixed rate it drains the probe's log and replays it into steps, resolves CUDA events (by
polling, never syncing), keeps a bounded history for late joiners, and publishes a Batch with
NOBLOCK: the new steps while anyone subscribes, telemetry always (an empty batch is the
heartbeat). In between it answers requests on the ROUTER socket. Bad frames
are counted and answered with an error; nothing a client sends can stop this thread.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from . import wire
from .capture import CaptureController, CaptureError
from .core import warn
from .cuda_timing import DeviceTimer, EventPool
from .probe import MAX_FAILURES, Probe
from .recorder import StepRecorder
from .sockets import AgentSockets
from .telemetry import TelemetryCollector

RATE_HZ = 10.0
HISTORY_STEPS = 10_000  # every step, for late joiners
SPARSE_STEPS = 6_000  # before those: one step per SPARSE_PERIOD_NS, so at least 10 minutes at any rate
SPARSE_PERIOD_NS = 100_000_000
CATCH_UP_STEPS = 2_000  # re-sent when the first subscriber arrives: covers a snapshot taken before it
SNAPSHOT_MAX = wire.SNAPSHOT_MAX_STEPS  # = HISTORY_STEPS + SPARSE_STEPS
REQUESTS_PER_TICK = 50  # more are left queued (and dropped at the socket's HWM): bounded agent CPU


class AgentLoop(threading.Thread):
    """Publishes batches and serves requests until `stop()`."""

    def __init__(
        self,
        probe: Probe,
        recorder: StepRecorder,
        sockets: AgentSockets,
        hello: Callable[[], wire.Hello],
        run_id: str,
        torch: Any,
        rank: int = 0,
        telemetry: TelemetryCollector | None = None,
        captures: CaptureController | None = None,
        rate_hz: float = RATE_HZ,
    ) -> None:
        super().__init__(name="torchtop-agent", daemon=True)
        self.probe = probe
        self.rec = recorder
        self.sockets = sockets
        self.hello = hello
        self.run_id = run_id
        self.torch = torch
        self.rank = rank
        self.telemetry = telemetry
        self.captures = captures
        self.period = 1.0 / rate_hz
        self.seq = 0
        # steps as (raw, device ms): made into StepRecords only when someone asks or listens
        self.history: deque[tuple[Any, Any]] = deque(maxlen=HISTORY_STEPS)
        self.sparse: deque[tuple[Any, Any]] = deque(maxlen=SPARSE_STEPS)  # downsampled, older
        self.subscribed = False  # anyone on the batch stream (XPUB tells first join, last leave)
        self._catch_up = False
        self.bad_requests = 0
        self._budget = REQUESTS_PER_TICK
        self._cuda_check_at = 0.0
        self.errors = 0
        self.timer = DeviceTimer(None)
        self._stop_event = threading.Event()
        self._wall_offset = time.time() - time.perf_counter_ns() / 1e9

    def stop(self, timeout: float = 2.0) -> None:
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout)

    # -- main loop -----------------------------------------------------------------------------
    def run(self) -> None:
        poller = zmq.Poller()
        router, pub = self.sockets.router, self.sockets.pub
        poller.register(router, zmq.POLLIN)
        poller.register(pub, zmq.POLLIN)
        next_tick = time.monotonic()
        while not self._stop_event.is_set():
            try:
                wait_ms = max(0.0, (next_tick - time.monotonic()) * 1000)
                if self._budget <= 0:  # a flood of requests waits for the next tick: it must not
                    self._stop_event.wait(wait_ms / 1000)  # take the training thread's GIL
                else:
                    ready = dict(poller.poll(wait_ms))
                    if pub in ready:
                        self._subscriptions()
                    if router in ready:
                        self._serve()
                now = time.monotonic()
                if now >= next_tick:
                    self._budget = REQUESTS_PER_TICK
                    self._tick()
                    next_tick = max(next_tick + self.period, now)
            except Exception as exc:
                self.errors += 1
                if self.errors == 1:  # say it once: a silent agent looks like a stuck run
                    warn(f"agent loop error ({type(exc).__name__}: {exc}); retrying")
                if self.errors > 1000:
                    return
                time.sleep(self.period)
        try:
            self._tick()  # the last steps before stop
        except Exception:
            pass

    # -- publishing ----------------------------------------------------------------------------
    def _maybe_enable_cuda(self) -> None:
        torch = self.torch
        if self.timer.pool is not None or torch is None or time.monotonic() < self._cuda_check_at:
            return
        self._cuda_check_at = time.monotonic() + 1.0
        try:
            # only once the user's code initialised CUDA (never create a context ourselves) and
            # holds memory on a GPU: torch.optim initialises CUDA on GPU machines even for a CPU
            # loop, which must not pay for events it cannot use
            if (
                torch.cuda.is_available()
                and torch.cuda.is_initialized()
                and any(torch.cuda.memory_reserved(i) > 0 for i in range(torch.cuda.device_count()))
            ):
                pool = EventPool(torch)
                self.timer.pool = pool
                self.rec.give = pool.give
                self.probe.sample_every = 8
                self.probe.pool = pool
        except Exception:
            self.errors += 1

    def _subscriptions(self) -> None:
        """(Un)subscription messages: b"\\x01" when the first subscriber joins, b"\\x00" when
        the last leaves. Anything else a peer sends is read and ignored."""
        pub = self.sockets.pub
        for _ in range(REQUESTS_PER_TICK):
            try:
                msg = pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if msg[:1] == b"\x01":
                if not self.subscribed:
                    self.subscribed, self._catch_up = True, True
            elif msg[:1] == b"\x00":
                self.subscribed = False

    def _to_record(self, raw: Any, device_ms: dict[str, float] | None) -> wire.StepRecord:
        index, kind, t0_ns, wall_ns, acc, micro, _events, extra = raw
        data, h2d, forward, backward, optimizer = acc
        phases = {  # a literal, not zip(): this runs for every step, holding the GIL
            "data": data, "h2d": h2d, "forward": forward, "backward": backward, "optimizer": optimizer,
            "other": max(0, wall_ns - data - h2d - forward - backward - optimizer),
        }
        record = wire.StepRecord(index, t0_ns / 1e9 + self._wall_offset, wall_ns, phases, kind, micro,
                                 device_ms or {}, self.rank)
        if extra:
            record.skipped = extra.get("skipped", 0)
            record.h2d_bytes = {k: extra[k] for k in ("pinned", "pageable") if k in extra}
            record.marks = _marks(extra.get("marks", ()))
        return record

    def _tick(self) -> None:
        self._maybe_enable_cuda()
        probe, rec = self.probe, self.rec
        ready = self.timer.run(rec.feed(probe.drain()))
        if rec.failures >= MAX_FAILURES and probe.active:
            probe.disable()  # the replay keeps failing: stop logging
        self._keep(ready)
        if self._catch_up:  # a first subscriber: what it may have missed between snapshot and now
            self._catch_up = False
            steps = [self._to_record(raw, ms) for raw, ms in list(self.history)[-CATCH_UP_STEPS:]]
        elif self.subscribed:
            steps = [self._to_record(raw, ms) for raw, ms in ready]
        else:
            steps = []  # nobody listens: a heartbeat; the steps wait in the history
        if self.timer.pool is not None:
            probe.sample_every = self.timer.stride(probe.sample_every)
            self.timer.pool.top_up()
        telemetry = None
        if self.telemetry is not None:
            self.telemetry.fast()
            telemetry = self.telemetry.latest()
        capture = None
        if self.captures is not None:
            self.captures.poll()
            capture = self.captures.current
        batch = wire.Batch(
            v=wire.PROTOCOL_VERSION,
            run_id=self.run_id,
            seq=self.seq,
            time=time.time(),
            steps=steps,
            dropped=probe.dropped,
            hook_errors=probe.failures + rec.failures,
            telemetry=telemetry,
            capture=capture,
        )
        try:
            self.sockets.pub.send(wire.encode(batch), zmq.NOBLOCK)
        except zmq.Again:
            pass
        self.seq += 1

    def _keep(self, steps: list[tuple[Any, Any]]) -> None:
        """Every step of the last HISTORY_STEPS; older ones thinned to one per SPARSE_PERIOD_NS."""
        history, sparse = self.history, self.sparse
        full = history.maxlen
        for step in steps:
            if len(history) == full:
                old = history[0]
                if not sparse or old[0][2] >= sparse[-1][0][2] + SPARSE_PERIOD_NS:
                    sparse.append(old)
            history.append(step)

    # -- requests ------------------------------------------------------------------------------
    def _serve(self) -> None:
        router = self.sockets.router
        while self._budget > 0:
            self._budget -= 1
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) < 2:
                self.bad_requests += 1
                continue
            envelope, payload = frames[:-1], frames[-1]
            reply = self._answer(payload)
            try:
                router.send_multipart([*envelope, wire.encode(reply)], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def _answer(self, payload: bytes) -> wire.Reply:
        v = wire.PROTOCOL_VERSION
        try:
            req = wire.decode(payload)
        except wire.WireError as exc:
            self.bad_requests += 1
            return wire.Reply(v=v, id=-1, ok=False, error=f"bad request: {exc}")
        if not isinstance(req, wire.Request):
            self.bad_requests += 1
            return wire.Reply(v=v, id=-1, ok=False, error=f"expected a request, got {type(req).__name__}")
        if req.cmd == "hello":
            return wire.Reply(v=v, id=req.id, ok=True, hello=self.hello(), seq=self.seq - 1)
        if req.cmd == "ping":
            return wire.Reply(v=v, id=req.id, ok=True, seq=self.seq - 1)
        if req.cmd == "snapshot":
            limit = req.args.get("max_steps", SNAPSHOT_MAX)
            if not isinstance(limit, int) or isinstance(limit, bool) or not 0 < limit <= SNAPSHOT_MAX:
                return wire.Reply(
                    v=v, id=req.id, ok=False, error=f"max_steps must be an integer in 1..{SNAPSHOT_MAX}"
                )
            kept = (list(self.sparse) + list(self.history))[-limit:]
            steps = [self._to_record(raw, ms) for raw, ms in kept]
            return wire.Reply(v=v, id=req.id, ok=True, steps=steps, seq=self.seq - 1)
        if req.cmd in ("capture-profile", "capture-memory", "capture-status") and self.captures is not None:
            return self._capture(req)
        self.bad_requests += 1
        return wire.Reply(v=v, id=req.id, ok=False, error=f"unknown command {req.cmd!r}")

    def _capture(self, req: wire.Request) -> wire.Reply:
        v, captures = wire.PROTOCOL_VERSION, self.captures
        assert captures is not None
        if req.cmd == "capture-status":
            return wire.Reply(v=v, id=req.id, ok=True, capture=captures.current, captures=captures.status())
        try:
            info = captures.request(req.cmd, req.args)
        except CaptureError as exc:
            return wire.Reply(v=v, id=req.id, ok=False, error=str(exc), capture=captures.current)
        return wire.Reply(v=v, id=req.id, ok=True, capture=info)


def _marks(marks: Any) -> dict[str, float]:
    """User marks as floats (CUDA ones were read by the timer once their copy landed)."""
    out: dict[str, float] = {}
    for name, value in marks:
        try:
            out[str(name)] = float(value[0]) if isinstance(value, tuple) else float(value)
        except Exception:
            continue
    return out
