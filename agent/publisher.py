"""The agent's own thread: everything that must not run on the training thread.

At a fixed rate it drains the probe's log, resolves the CUDA events in it (by polling, never
syncing), keeps a bounded history of log chunks for late joiners, and publishes a Batch with
NOBLOCK: the new chunks while anyone subscribes, telemetry always (an empty batch is the
heartbeat). It does not make steps of the log: the monitor replays it (monitor/replay.py), so
this thread, which shares the GIL with training, does a copy and an encode per tick and no
Python work per step. In between it answers requests on the ROUTER socket. Bad frames are
counted and answered with an error; nothing a client sends can stop this thread.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from . import wire
from .capture import CaptureController, CaptureError
from .core import warn
from .cuda_timing import EventPool, EventResolver
from .probe import UNTIMED, WAKE, Probe
from .sockets import AgentSockets
from .telemetry import TelemetryCollector

RATE_HZ = 10.0
QUIET_RATE_HZ = 2.0  # ticks while nobody is subscribed: the log still drains into the history
HISTORY_ENTRIES = 150_000  # every entry of the last ~15k steps (~10 a step), for late joiners
SPARSE_CHUNKS = 6_000  # before those: one step per chunk (~one per tick): 10 minutes at any rate
CATCH_UP_CHUNKS = 30  # re-sent when the first subscriber arrives: covers a snapshot taken before it
CATCH_UP_ENTRIES = 500_000  # ... and at most this many entries (~5 MB: a frame's limit is 16 MiB)
SNAPSHOT_MAX = wire.SNAPSHOT_MAX_STEPS
REQUESTS_PER_TICK = 50  # more are left queued (and dropped at the socket's HWM): bounded agent CPU
# A wake this close to the tick ticks now. zmq's poll counts whole milliseconds on a coarse clock
# and may return a little early: waiting out the rest in 0 ms polls spun this thread ~35 times a
# tick, and every spin took the GIL from the training thread (which then blocked on it 116 times in
# 2 s of a 1.9 ms loop, against 41 with one wake a tick).
TICK_EARLY_S = 0.002
LIGHT_IDLE_S = 1.0  # no step ended this long in an untimed stretch: an eval loop? time it again
QUIET_TELEMETRY_S = 1.0  # nobody subscribed: memory and NVML sampled this often


class AgentLoop(threading.Thread):
    """Publishes batches and serves requests until `stop()`."""

    def __init__(
        self,
        probe: Probe,
        sockets: AgentSockets,
        hello: Callable[[], wire.Hello],
        run_id: str,
        torch: Any,
        rank: int = 0,
        telemetry: TelemetryCollector | None = None,
        captures: CaptureController | None = None,
        rate_hz: float = RATE_HZ,
        chores: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(name="torchtop-agent", daemon=True)
        self.probe = probe
        self.sockets = sockets
        self.hello = hello
        self.run_id = run_id
        self.torch = torch
        self.rank = rank
        self.telemetry = telemetry
        self.captures = captures
        self.chores = chores  # the hooks' work for this thread (AutoHooks.agent_tick)
        self.period = 1.0 / rate_hz
        self.seq = 0
        self.chunk_seq = 0
        self.history: deque[wire.LogChunk] = deque()  # every entry, up to HISTORY_ENTRIES
        self._history_entries = 0
        self.sparse: deque[wire.LogChunk] = deque(maxlen=SPARSE_CHUNKS)  # older: a step per chunk
        self.subscribed = False  # anyone on the batch stream (XPUB tells first join, last leave)
        self._catch_up = False
        self.bad_requests = 0
        self._budget = REQUESTS_PER_TICK
        self._cuda_check_at = 0.0
        self.errors = 0
        self.resolver = EventResolver(None)
        self._stop_event = threading.Event()
        self._wall_offset = time.time() - time.perf_counter_ns() / 1e9
        self._light_seen = (-1, 0.0)  # (training steps, when that count was first seen)
        self.ticks = 0
        self._telemetry_due = 0.0  # nobody subscribed: when memory and NVML are sampled next
        self.busy_ns = 0  # this thread's CPU time at work (holding the GIL, mostly), not waiting

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
                wait_ms = math.ceil(max(0.0, next_tick - time.monotonic()) * 1000)
                if self._budget <= 0:  # a flood of requests waits for the next tick: it must not
                    self._stop_event.wait(wait_ms / 1000)  # take the training thread's GIL
                    busy = time.thread_time_ns()
                else:
                    ready = dict(poller.poll(wait_ms))
                    busy = time.thread_time_ns()
                    if pub in ready and self._subscriptions():
                        next_tick = time.monotonic()  # a first subscriber: its catch-up now
                    if router in ready:
                        self._serve()
                now = time.monotonic()
                if now >= next_tick - TICK_EARLY_S:
                    self._budget = REQUESTS_PER_TICK
                    self._tick()
                    period = self.period if self.subscribed else max(self.period, 1.0 / QUIET_RATE_HZ)
                    next_tick = max(next_tick + period, now)
                self.busy_ns += time.thread_time_ns() - busy
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
        if self.resolver.pool is not None or torch is None or time.monotonic() < self._cuda_check_at:
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
                self.resolver.pool = pool
                self.probe.sample_every = 8
                self.probe.pool = pool
        except Exception:
            self.errors += 1

    def _subscriptions(self) -> bool:
        """(Un)subscription messages: b"\\x01" when the first subscriber joins, b"\\x00" when
        the last leaves. Anything else a peer sends is read and ignored. True when a first
        subscriber came."""
        pub = self.sockets.pub
        joined = False
        for _ in range(REQUESTS_PER_TICK):
            try:
                msg = pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            if msg[:1] == b"\x01":
                if not self.subscribed:
                    self.subscribed, self._catch_up, joined = True, True, True
            elif msg[:1] == b"\x00":
                self.subscribed = False
        return joined

    def _watch_light(self) -> None:
        """An untimed stretch (phase sampling) ends at a training step's end. When none has
        ended for LIGHT_IDLE_S (an evaluation loop, a pause), the next root forward times
        again (probe.wake, on the training thread): this thread only writes `light`."""
        probe, now = self.probe, time.monotonic()
        steps = probe.steps
        if steps != self._light_seen[0]:
            self._light_seen = (steps, now)
        elif probe.light == UNTIMED and now - self._light_seen[1] > LIGHT_IDLE_S:
            probe.light = WAKE

    def _tick(self) -> None:
        self.ticks += 1
        self._maybe_enable_cuda()
        self._watch_light()
        if self.chores is not None:
            try:
                self.chores()
            except Exception:
                self.errors += 1
        probe, resolver = self.probe, self.resolver
        if resolver.pool is None and not probe.cuda_marks:
            raw, steps = probe.drain_pairs()
            if not probe.cuda_marks:  # set before a CUDA mark is logged: none is in `raw`
                # a CPU run: nothing to resolve; the monitor converts the pairs (wire.to_entries)
                ready, pairs = [(raw, steps)], True
            else:  # the run's first CUDA mark came meanwhile: its event is read here
                ready, pairs = resolver.run(wire.to_entries(raw)[0], steps), False
        else:
            ready, pairs = resolver.run(*probe.drain()), False
        new = []
        for entries, steps in ready:
            if entries:
                new.append(wire.LogChunk(self.chunk_seq, steps, entries, pairs))
                self.chunk_seq += 1
        for chunk in new:
            self._keep(chunk)
        if resolver.pool is not None:
            probe.sample_every = resolver.stride(probe.sample_every)
            resolver.pool.top_up()
        if self.captures is not None:
            self.captures.poll()
        attended = self.subscribed or self._catch_up
        if self.telemetry is not None:
            self.telemetry.attended = attended
            now = time.monotonic()
            if attended or now >= self._telemetry_due:
                self._telemetry_due = now + QUIET_TELEMETRY_S
                self.telemetry.fast()
        if not attended:
            return  # nobody listens: the chunks wait in the history; nothing to encode or send
        if self._catch_up:  # a first subscriber: what it may have missed between snapshot and now
            self._catch_up = False
            log = self._recent(CATCH_UP_CHUNKS, CATCH_UP_ENTRIES)
        else:
            log = new
        batch = wire.Batch(
            v=wire.PROTOCOL_VERSION,
            run_id=self.run_id,
            seq=self.seq,
            time=time.time(),
            log=log,
            wall_offset=self._wall_offset,
            rank=self.rank,
            dropped=probe.dropped,
            hook_errors=probe.failures,
            telemetry=self.telemetry.latest() if self.telemetry is not None else None,
            capture=self.captures.current if self.captures is not None else None,
        )
        try:
            self.sockets.pub.send(wire.encode(batch), zmq.NOBLOCK)
        except zmq.Again:
            pass
        self.seq += 1  # only batches sent: a subscriber counts the missing numbers as gaps

    def _keep(self, chunk: wire.LogChunk) -> None:
        """Every entry of the last HISTORY_ENTRIES; older chunks thinned to their last step."""
        history = self.history
        history.append(chunk)
        self._history_entries += _size(chunk)
        while self._history_entries > HISTORY_ENTRIES and len(history) > 1:
            old = history.popleft()
            self._history_entries -= _size(old)
            tail = _last_step_pairs(old.entries) if old.pairs else _last_step(old.entries)
            if tail is not None:
                self.sparse.append(wire.LogChunk(old.seq, old.steps, tail, old.pairs))

    def _recent(self, chunks: int, entries: int) -> list[wire.LogChunk]:
        out: list[wire.LogChunk] = []
        for chunk in reversed(self.history):
            entries -= _size(chunk)
            if len(out) == chunks or (out and entries < 0):
                break
            out.append(chunk)
        return out[::-1]

    def _snapshot(self, limit: int) -> list[wire.LogChunk]:
        """Chunks holding at least `limit` steps (or all there are), oldest first: the newest
        full chunks, then thinned ones (a step each) before them."""
        history = list(self.history)
        if not history:
            return list(self.sparse)[-limit:]
        newest = history[-1].steps
        k = len(history)
        while k > 0 and newest - history[k - 1].steps < limit:
            k -= 1
        if k > 0:  # one chunk more: it holds the boundary the first step starts at
            return history[k - 1:]
        more = limit - (newest - history[0].steps)
        return (list(self.sparse)[-more:] if more > 0 else []) + history

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
            return wire.Reply(
                v=v, id=req.id, ok=True, run_id=self.run_id, log=self._snapshot(limit),
                wall_offset=self._wall_offset, rank=self.rank, seq=self.seq - 1,
            )
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


def _last_step(entries: list[Any]) -> list[Any] | None:
    """A chunk thinned for the sparse history: RESET, then its entries from its second-to-last
    step boundary on (one whole step, and the start of the next, which the following chunk
    continues). None when the chunk does not hold a whole training step."""
    end = None
    for k in range(len(entries) - 1, -1, -1):
        if wire.is_step_end(entries[k]):
            if end is not None:
                return [wire.RESET, *entries[k:]]
            end = k
    return None


def _last_step_pairs(items: list[Any]) -> list[Any] | None:
    """`_last_step` for a chunk of (time, code) pairs."""
    end = None
    for k in range(len(items) - 1, 0, -2):
        code = items[k]
        if (code if type(code) is int else code[0]) in wire.STEP_ENDS:
            if end is not None:
                return [0, wire.RESET, *items[k - 1:]]
            end = k
    return None


def _size(chunk: wire.LogChunk) -> int:
    """Entries in a chunk (a pair is one)."""
    return len(chunk.entries) // 2 if chunk.pairs else len(chunk.entries)
