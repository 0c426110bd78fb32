"""The agent's own thread: everything that must not run on the training thread.

At a fixed rate it drains the probe's log, resolves the CUDA events in it (by polling, never
syncing), keeps a bounded history of log chunks for late joiners, and publishes a Batch with
NOBLOCK: the new chunks while anyone subscribes, telemetry always (an empty batch is the
heartbeat). It does not make steps of the log: the monitor replays it (monitor/model/replay.py),
so this thread, which shares the GIL with training, does a copy and an encode per tick and no
Python work per step. In between it lets the request router (requests.py) answer requests on
the ROUTER socket, within a budget per tick.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from torchtop.agent.hooks.phase_sampling import UNTIMED, WAKE
from torchtop.agent.loop.cuda_events import EventPool, EventResolver
from torchtop.agent.loop.history import LogHistory
from torchtop.agent.loop.requests import WINDOW_S, RequestRouter
from torchtop.agent.loop.tally import StepCounter
from torchtop.agent.warn import warn
from torchtop.contract import logcodes, wire

if TYPE_CHECKING:
    from torchtop.agent.capture.controller import CaptureController
    from torchtop.agent.cuda_use import CudaUse
    from torchtop.agent.hooks.probe import Probe
    from torchtop.agent.loop.recorder import Recorder
    from torchtop.agent.loop.sockets import AgentSockets
    from torchtop.agent.telemetry.collector import TelemetryCollector
    from torchtop.agent.telemetry.why import WhyCollector

RATE_HZ = 10.0  # the fastest tick, while a monitor watches and a tick costs little
QUIET_RATE_HZ = 2.0  # ticks while nobody is subscribed: the log still drains into the history
# While watched, the ticks slow down (to SLOWEST_RATE_HZ at most) so that their CPU time, which
# mostly holds the GIL that training needs, stays under this share of the wall clock: fewer,
# larger ticks carry the same steps for less fixed work (docs/benchmarks.md, the attached cost).
TICK_SHARE = 0.0005
# the slowest watched rate: a tick is ~0.3-0.9 ms of fixed work (telemetry, encoding, the send)
# whatever the steps it carries; at 2 Hz that was ~0.1-0.2% of a launch-bound step. Once a second
# is htop's own pace, and the replay shows every step all the same
SLOWEST_RATE_HZ = 1.0
CATCH_UP_CHUNKS = 30  # re-sent when the first subscriber arrives: covers a snapshot taken before it
CATCH_UP_ENTRIES = 500_000  # ... and at most this many entries (~5 MB: a frame's limit is 16 MiB)
STREAM_FRAMES_PER_WINDOW = 100  # frames read off the stream socket per request window (requests.py)
# A wake this close to the tick ticks now: zmq's poll counts whole milliseconds and may return a
# little early, and waiting out the rest in 0 ms polls took the GIL from training at every spin.
TICK_EARLY_S = 0.002
UNTIMED_IDLE_S = 1.0  # no step ended this long in an untimed stretch: an eval loop? time it again
QUIET_TELEMETRY_S = 1.0  # nobody subscribed: memory and NVML sampled this often
HELLO_RECORD_S = 5.0  # the Hello is handed to the recorder this often (it keeps it when it changed)


class AgentLoop(threading.Thread):
    """Publishes batches and serves requests until `stop()`."""

    def __init__(
        self,
        probe: Probe,
        sockets: AgentSockets,
        hello: Callable[[], wire.Hello],
        run_id: str,
        cuda: CudaUse | None = None,
        rank: int = 0,
        telemetry: TelemetryCollector | None = None,
        captures: CaptureController | None = None,
        rate_hz: float = RATE_HZ,
        chores: Callable[[], None] | None = None,
        why: WhyCollector | None = None,
        recorder: Recorder | None = None,
    ) -> None:
        super().__init__(name="torchtop-agent", daemon=True)
        self.probe = probe
        self.sockets = sockets
        self.hello = hello
        self.run_id = run_id
        self.cuda = cuda  # None: never look for CUDA (tests of the CPU path)
        self.rank = rank
        self.telemetry = telemetry
        if telemetry is not None:  # the memory samples say after how many steps (the leak rule's x)
            telemetry.step_count = lambda: probe.steps
        self.captures = captures
        self.chores = chores  # the hooks' work for this thread (AutoHooks.agent_tick)
        self.why = why  # stack samples, sync windows, the FLOP count (telemetry/why.py)
        self.period = 1.0 / rate_hz
        self.seq = 0
        self.chunk_seq = 0
        self.history = LogHistory()
        self.counter = StepCounter()  # every step of the run, counted (for late joiners)
        self.subscribed = False  # anyone on the batch stream (XPUB tells first join, last leave)
        self.watched = False  # a monitor among them (wire.WATCH_TOPIC), not only a node's relay
        self._catch_up = False
        self._stream_frames = STREAM_FRAMES_PER_WINDOW
        self.bad_stream_frames = 0  # frames on the stream port that are not a (un)subscription to all
        self.errors = 0
        self.resolver = EventResolver(None)
        self._stop_event = threading.Event()
        # stop() writes a byte here: the poll wakes at once, not at the next tick (up to 0.5 s)
        self._waker, self._wake = socket.socketpair()
        self._waker.setblocking(False)
        self._wall_offset = time.time() - time.perf_counter_ns() / 1e9
        self.router = RequestRouter(
            hello,
            self.history,
            lambda: self.seq - 1,
            run_id,
            rank,
            self._wall_offset,
            captures,
            self.counter,
            telemetry.trend.lows if telemetry is not None else None,
        )
        self._untimed_seen = (-1, 0.0)  # (training steps, when that count was first seen)
        self.ticks = 0
        self._telemetry_due = 0.0  # nobody subscribed: when memory and NVML are sampled next
        self.busy_ns = 0  # this thread's CPU time at work (holding the GIL, mostly), not waiting
        self.recorder = recorder  # a recording on disk: every tick's new chunks, watched or not
        self._hello_due = 0.0
        self.tick_ns = 0.0  # a tick's CPU time (a moving average): sets the watched tick rate

    def tick_period(self) -> float:
        """Seconds to the next tick: RATE_HZ while watched if the ticks are cheap, slower (down to
        SLOWEST_RATE_HZ) so that they take at most TICK_SHARE of the time, QUIET_RATE_HZ when
        nobody is subscribed."""
        if not self.watched:  # nobody, or only a node's relay (its summaries are 1-2 Hz)
            return max(self.period, 1.0 / QUIET_RATE_HZ)
        slowest = max(self.period, 1.0 / SLOWEST_RATE_HZ)
        return min(slowest, max(self.period, self.tick_ns / 1e9 / TICK_SHARE))

    @property
    def bad_requests(self) -> int:
        """What peers sent that was refused: malformed or oversized requests, stream junk."""
        return self.router.bad_requests + self.bad_stream_frames

    def stop(self, timeout: float = 2.0) -> None:
        self._stop_event.set()
        try:
            self._waker.send(b"\0")
        except OSError:  # closed by an earlier stop, or full: the loop wakes anyway
            pass
        if self.is_alive():
            self.join(timeout)
        if not self.is_alive():
            self._waker.close()
            self._wake.close()

    # -- main loop -----------------------------------------------------------------------------
    def run(self) -> None:
        router, pub = self.sockets.router, self.sockets.pub
        requests = self.router
        pollers = _pollers(router, pub, self._wake)
        next_tick = time.monotonic()
        window_end = 0.0  # request budgets refill when a wake finds this passed
        while not self._stop_event.is_set():
            try:
                busy = time.thread_time_ns()  # work from waking to waiting again, both sides of a wait
                now = time.monotonic()
                if now >= window_end:
                    window_end = now + WINDOW_S
                    requests.refill(router, now)
                    self._stream_frames = STREAM_FRAMES_PER_WINDOW
                # a spent budget waits for the next window, not polled: what floods in must not
                # take the training thread's GIL faster than the budget allows
                socks = tuple(
                    s
                    for s, open_ in ((router, not requests.starved()), (pub, self._stream_frames > 0))
                    if open_
                )
                wake = next_tick
                if len(socks) < 2 or requests.waiting():
                    wake = min(wake, window_end)
                wait_ms = math.ceil(max(0.0, wake - now) * 1000)
                self.busy_ns += time.thread_time_ns() - busy
                if socks:
                    ready = dict(pollers[socks].poll(wait_ms))
                else:
                    self._stop_event.wait(wait_ms / 1000)
                    ready = {}
                busy = time.thread_time_ns()
                if pub in ready and self._subscriptions():
                    next_tick = time.monotonic()  # a first subscriber: its catch-up now
                if router in ready:
                    requests.serve(router, time.monotonic())
                    if requests.renew:  # a frame bomb: a fresh socket frees it at once
                        self.sockets.renew_router()
                        requests.renewed()
                        router = self.sockets.router
                        pollers = _pollers(router, pub, self._wake)
                now = time.monotonic()
                if now >= next_tick - TICK_EARLY_S:
                    self.sockets.maybe_trim(now)
                    ticked = time.thread_time_ns()
                    catch_up = self._catch_up
                    self._tick()
                    if not catch_up:  # a catch-up re-sends history: not what the next tick costs
                        ticked = time.thread_time_ns() - ticked
                        self.tick_ns = ticked if not self.tick_ns else 0.8 * self.tick_ns + 0.2 * ticked
                    next_tick = max(next_tick + self.tick_period(), now)
                self.busy_ns += time.thread_time_ns() - busy
            except Exception as exc:  # broad: the agent thread outlives a tick's failure
                self.errors += 1
                if self.errors == 1:  # say it once: a silent agent looks like a stuck run
                    warn(f"agent loop error ({type(exc).__name__}: {exc}); retrying")
                if self.errors > 1000:
                    return
                time.sleep(self.period)
        try:
            self._telemetry_due = self._hello_due = 0.0  # a recording ends with the latest of both
            self._tick()  # the last steps before stop
        except Exception:  # broad: the last tick at stop is best effort
            pass

    # -- publishing ----------------------------------------------------------------------------
    def _maybe_enable_cuda(self) -> None:
        """Device timing from the first tick on which the run holds GPU memory."""
        if self.resolver.pool is not None or self.cuda is None:
            return
        try:
            if self.cuda.holds_memory():
                pool = EventPool(self.cuda.torch)
                self.resolver.pool = pool
                self.probe.event_every = 8
                self.probe.pool = pool
                from torchtop.agent.hooks import nvtx

                if nvtx.wanted():  # TORCHTOP_NVTX=1: the phases as NVTX ranges on event steps
                    nvtx.enable(self.probe, self.cuda.torch.cuda.nvtx)
                self._hello_due = 0.0  # the run is on CUDA now: a recording's Hello says so
        except Exception:  # broad: CUDA timing is optional: a failure is counted
            self.errors += 1

    def _subscriptions(self) -> bool:
        """(Un)subscription messages: b"\\x01" when the first subscriber to everything joins,
        b"\\x00" when the last leaves (a monitor subscribes to everything). Anything else a peer
        sends (a topic, a message, a frame of one) is read within the window's budget, counted
        and ignored. True when a first subscriber came."""
        pub = self.sockets.pub
        joined = False
        while self._stream_frames > 0:
            try:
                msg = pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._stream_frames -= 1
            if msg == b"\x01":
                if not self.subscribed:
                    self.subscribed, self._catch_up, joined = True, True, True
            elif msg == b"\x00":
                self.subscribed = False
            elif msg == b"\x01" + wire.WATCH_TOPIC:
                if not self.watched:  # a monitor, maybe beside a relay: its catch-up too
                    self.watched, self._catch_up, joined = True, True, True
            elif msg == b"\x00" + wire.WATCH_TOPIC:
                self.watched = False
            else:
                self.bad_stream_frames += 1
        return joined

    def _watch_untimed(self) -> None:
        """An untimed stretch (phase sampling) ends at a training step's end. When none has
        ended for UNTIMED_IDLE_S (an evaluation loop, a pause), the next root forward times
        again (probe.wake, on the training thread): this thread only writes `untimed`."""
        probe, now = self.probe, time.monotonic()
        steps = probe.steps
        if steps != self._untimed_seen[0]:
            self._untimed_seen = (steps, now)
        elif probe.untimed == UNTIMED and now - self._untimed_seen[1] > UNTIMED_IDLE_S:
            probe.untimed = WAKE

    def _tick(self) -> None:
        self.ticks += 1
        self._maybe_enable_cuda()
        self._watch_untimed()
        if self.chores is not None:
            try:
                self.chores()
            except Exception:  # broad: the hooks' chores never end the agent thread (counted)
                self.errors += 1
        probe, resolver = self.probe, self.resolver
        if resolver.pool is None and not probe.cuda_marks:
            raw, steps = probe.drain_pairs()
            if not probe.cuda_marks:  # set before a CUDA mark is logged: none is in `raw`
                # a CPU run: nothing to resolve; the monitor converts the pairs (logcodes.to_entries)
                ready, pairs = [(raw, steps)], True
            else:  # the run's first CUDA mark came meanwhile: its event is read here
                ready, pairs = resolver.run(logcodes.to_entries(raw)[0], steps), False
        else:
            ready, pairs = resolver.run(*probe.drain()), False
        new = []
        for entries, steps in ready:
            if entries:
                new.append(wire.LogChunk(self.chunk_seq, steps, entries, pairs))
                self.chunk_seq += 1
        for chunk in new:
            self.history.keep(chunk)
            self.counter.keep(chunk)
        if resolver.pool is not None:
            probe.event_every = resolver.stride(probe.event_every)
            resolver.pool.top_up()
        if self.captures is not None:
            self.captures.poll()
        attended = self.watched or self._catch_up  # the why probes and fast telemetry: for a monitor
        recorder = self.recorder
        if self.why is not None:
            # a recording keeps the stack samples too (its report names the hot code), watched or not
            self.why.tick(attended or recorder is not None)
        sampled = False
        if self.telemetry is not None:
            self.telemetry.attended = attended
            now = time.monotonic()
            if attended or now >= self._telemetry_due:
                self._telemetry_due = now + QUIET_TELEMETRY_S
                self.telemetry.fast()
                sampled = True
        if recorder is not None:
            self._record_hello(recorder)
        if not (self.subscribed or self._catch_up):
            # nobody listens: the chunks wait in the history; nothing is sent, and only a
            # recording gets a batch (encoded on its own thread), with the stack samples since the last
            if recorder is not None and (new or sampled):
                why = self.why.message() if self.why is not None else None
                recorder.put(self._batch(new, sampled, why))
                self.seq += 1
            return
        catch_up = self._catch_up
        why = self.why.message(catch_up) if self.why is not None else None
        if catch_up:  # a first subscriber: what it may have missed between snapshot and now
            self._catch_up = False
            log = self.history.recent(CATCH_UP_CHUNKS, CATCH_UP_ENTRIES)
        else:
            log = new
        batch = self._batch(log, True, why)
        frame = wire.encode(batch)
        try:
            self.sockets.pub.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            pass
        if recorder is not None:  # the frame as sent, unless it repeats chunks recorded before
            if log is new:
                recorder.put(batch, frame)
            else:
                recorder.put(self._batch(new, True, why))
        self.seq += 1  # batches built (sent, or recorded): a subscriber counts missing numbers as gaps

    def _batch(self, log: list[wire.LogChunk], telemetry: bool, why: wire.Why | None = None) -> wire.Batch:
        capture = self.captures.current if self.captures is not None else None
        return wire.Batch(
            v=wire.PROTOCOL_VERSION,
            run_id=self.run_id,
            seq=self.seq,
            time=time.time(),
            log=log,
            wall_offset=self._wall_offset,
            rank=self.rank,
            dropped=self.probe.dropped,
            hook_errors=self.probe.failures,
            telemetry=self.telemetry.latest() if telemetry and self.telemetry is not None else None,
            capture=capture,
            why=why,
            bad_requests=self.bad_requests,
            dropped_requests=self.router.dropped_requests,
        )

    def _record_hello(self, recorder: Recorder) -> None:
        """The Hello at the start and every few seconds: the device is known once the model
        is on it (the recorder writes it only when it changed)."""
        now = time.monotonic()
        if now >= self._hello_due:
            self._hello_due = now + HELLO_RECORD_S
            recorder.put(self.hello())


def _pollers(router: Any, pub: Any, wake: socket.socket) -> dict[tuple[Any, ...], Any]:
    """A poller for each set of sockets the loop may wait on, each with stop()'s wake-up."""
    pollers = {}
    for socks in ((router, pub), (router,), (pub,)):
        pollers[socks] = poller = zmq.Poller()
        for sock in socks:
            poller.register(sock, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
    return pollers
