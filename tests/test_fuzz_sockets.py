"""Both of the agent's sockets fuzzed at once, in bounded time (issue 17): the ROUTER (requests)
and the XPUB (the stream: subscriptions, and whatever else a peer sends up it).

Hypothesis makes the traffic: random frames and multipart messages of every size up to
thousands of frames, (un)subscriptions to random topics, valid but hostile requests in bursts
(snapshots of the whole history, hellos, capture-status, captures with bad arguments) and raw
bytes on both sockets. A real training loop runs in a child process with a real monitor on its
stream and asking it hellos all along. Quiet and fuzzed windows alternate, so the machine's own
load drifts out of the ratios. The agent must keep training at speed, answer the monitor, keep
its memory, and count what it refused.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import psutil
import pytest
import zmq
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from tests.agent_util import median
from tests.load_util import Watcher, send_raw
from tests.remote_util import training_agent
from torchtop.contract import wire
from torchtop.monitor.link.client import AgentClient, AgentUnreachable
from torchtop.monitor.link.targets import Endpoint, from_discovery

pytest.importorskip("torch")
pytestmark = pytest.mark.slow

MB = 1 << 20
V = wire.PROTOCOL_VERSION


def _request(cmd: str, **args: object) -> bytes:
    return wire.encode(wire.Request(v=V, id=1, cmd=cmd, args=dict(args)))


NAN = float("nan")
PROBE = "probe"  # a valid batch's run: it only tells that the stream is live
HOSTILE = [
    _request("snapshot", max_steps=wire.SNAPSHOT_MAX_STEPS),  # the costliest answer
    _request("snapshot", max_steps=NAN),  # non-finite numbers: refused at decode (issue 26)
    _request("capture-memory", seconds=float("inf")),
    wire.encode(wire.Batch(v=V, run_id="x", seq=0, time=NAN)),  # a NaN batch, up the wrong socket
    _request("snapshot", max_steps=0),
    _request("hello"),
    _request("ping"),
    _request("capture-status"),
    _request("capture-profile", steps=10**9),  # refused: no capture starts
    _request("capture-memory", steps=-1),
    _request("shutdown"),
]
small = st.binary(max_size=48)
frames = st.lists(small | st.binary(min_size=200, max_size=4096), min_size=1, max_size=6)
oversized = st.integers(4, 6000).map(lambda n: [b"x"] * n) | st.just([b"\x00" * 60_000, b"y" * 10_000])
hostile = st.tuples(st.sampled_from(HOSTILE), st.integers(1, 40))
topic = st.binary(max_size=32)
subscriptions = st.lists(
    topic.map(lambda t: b"\x01" + t) | topic.map(lambda t: b"\x00" + t) | small, min_size=1, max_size=5
)
raw = st.binary(max_size=512)
# multipart bombs past the agent's discard bound (requests.DISCARD_MAX): the socket is renewed
bombs = st.none() | st.none() | st.integers(10_000, 60_000)
FUZZ = settings(deadline=None, database=None, suppress_health_check=list(HealthCheck))  # pyright: ignore[reportArgumentType]  # hypothesis: its enum metaclass has an untyped __iter__


class SocketFuzzer:
    """Throws hypothesis-made traffic at an agent's two ports from zmq peers and raw TCP."""

    def __init__(self, addresses: tuple[str, str]) -> None:
        self.addresses = addresses  # (requests, stream)
        self.ctx = zmq.Context()
        self.dealer = self._sock(zmq.DEALER, addresses[0])  # decodable junk and hostile requests
        self.xsub = self._sock(zmq.XSUB, addresses[1])  # sends anything upstream as "subscriptions"
        self.examples = 0
        self.bombs = 0

    def _sock(self, kind: int, address: str) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 10_000)
        sock.connect(address)
        return sock

    def _send(self, sock: zmq.Socket, parts: list[bytes]) -> None:
        try:
            sock.send_multipart(parts, zmq.NOBLOCK)
        except zmq.Again:
            pass

    def run(self, examples: int, round_: int) -> None:
        @seed(round_)
        @settings(FUZZ, max_examples=examples)
        @given(
            junk=frames, big=st.none() | oversized, burst=hostile, subs=subscriptions, blob=raw, bomb=bombs
        )
        def throw(junk, big, burst, subs, blob, bomb) -> None:  # type: ignore[no-untyped-def]
            self._send(self.dealer, junk)
            payload, times = burst
            for _ in range(times):
                self._send(self.dealer, [payload])
            if big is not None:  # from a peer of its own: the agent ignores a peer that sent one
                bomber = self._sock(zmq.DEALER, self.addresses[0])
                self._send(bomber, big)
                bomber.close(linger=200)
            if bomb is not None:
                bomber = self._sock(zmq.DEALER, self.addresses[0])
                self._send(bomber, [b""] * bomb)
                bomber.close(linger=500)
                self.bombs += 1
            self._send(self.xsub, subs)
            while self.dealer.poll(0):
                self.dealer.recv_multipart()
            send_raw(self.addresses[self.examples & 1], blob)
            self.examples += 1

        throw()

    def close(self) -> None:
        self.ctx.destroy(linger=0)


class Pinger(threading.Thread):
    """A real monitor asking hello every 0.1 s: how long each took (None: not answered in 5 s)."""

    def __init__(self, endpoint: Endpoint) -> None:
        super().__init__(daemon=True)
        self.endpoint = endpoint
        self.times: list[float | None] = []
        self.halt = threading.Event()

    def run(self) -> None:
        client = AgentClient(self.endpoint)
        try:
            while not self.halt.wait(0.1):
                t = time.perf_counter()
                try:
                    client.hello(timeout=5)
                    self.times.append(time.perf_counter() - t)
                except AgentUnreachable:
                    self.times.append(None)
        finally:
            client.close()


def test_fuzzing_both_sockets_leaves_training_monitors_and_memory_alone(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    # trains until stopped: the default 120 s could run out before a loaded machine's three rounds
    with training_agent(tmp_path, subprocess_env, seconds=600) as (proc, info):
        endpoint = from_discovery(info)
        watcher = Watcher(endpoint)
        watcher.start()
        pinger = Pinger(endpoint)
        fuzzer = SocketFuzzer((endpoint.address, endpoint.pub_address))
        quiet: list[float] = []
        fuzzed: list[float] = []
        try:
            watcher.wait_steps(500)
            process = psutil.Process(proc.pid)
            rss = peak = process.memory_info().rss
            pinger.start()
            for round_ in range(3):
                start = time.time()
                time.sleep(2.0)
                quiet += watcher.between(start, time.time())
                start = time.time()
                fuzzer.run(100, round_)
                end = time.time()
                peak = max(peak, process.memory_info().rss)
                watcher.wait_until(end)
                fuzzed += watcher.between(start, end)
                assert proc.poll() is None, "the training process died"
            time.sleep(1.0)  # the last answers
        finally:
            pinger.halt.set()
            fuzzer.close()
            pinger.join(10)
            watcher.halt.set()
            watcher.join(5)
        last = watcher.last
    ratio = median(fuzzed) / median(quiet)
    answered = sorted(t for t in pinger.times if t is not None)
    print(
        f"\nfuzz: {fuzzer.examples} examples; median step {median(quiet):.3f} ms quiet ({len(quiet)}), "
        f"{median(fuzzed):.3f} ms fuzzed ({len(fuzzed)}): x{ratio:.2f}; RSS +{(peak - rss) / MB:.0f} MB; "
        f"monitor hellos {len(answered)}/{len(pinger.times)} answered, median {median(answered) * 1e3:.1f} ms, "
        f"max {answered[-1] * 1e3:.0f} ms; agent refused {last.bad_requests if last else '?'}, "
        f"dropped {last.dropped_requests if last else '?'}"
    )
    assert fuzzer.examples == 300 and fuzzer.bombs > 0 and len(quiet) > 100 and len(fuzzed) > 100
    assert ratio < 1.5, f"the training loop slowed x{ratio:.2f} under fuzzing"
    assert len(answered) == len(pinger.times) > 20, "the monitor's hellos went unanswered"
    assert median(answered) < 0.1
    assert peak - rss < 64 * MB, f"the training process grew {(peak - rss) / MB:.0f} MB"
    assert last is not None and last.bad_requests > 100 and last.dropped_requests > 0  # counted, said


# -- the monitor's side: what a same-user process may publish (issue 26, item 2) ------------------
numbers = st.floats(allow_nan=True, allow_infinity=True) | st.integers(-(2**63), 2**64 - 1)
finite = st.floats(-1e6, 1e6)


@st.composite
def hostile_batches(draw: st.DrawFn, seq: int = 0) -> wire.Batch:
    """A batch of real steps with numbers anywhere a float goes: NaN, inf, huge, or fine."""
    from tests.hostile_agent import steps_log

    t0 = 10**15 + draw(st.integers(0, 10**9))
    log = steps_log(t0, draw(st.integers(0, 5)), device_ms=draw(st.none() | numbers))
    if log and draw(st.booleans()):
        k = draw(st.integers(0, len(log) - 1))
        log[k] = (log[k] if type(log[k]) is int else log[k][0], draw(numbers))
    host = wire.HostSample(
        proc_cpu=draw(finite | numbers),
        proc_rss=1,
        threads=1,
        cpu_count=2,
        mem_percent=draw(finite | numbers),
    )
    return wire.Batch(
        v=V, run_id="fuzz", seq=seq, time=draw(st.just(1.8e9) | numbers),
        log=[wire.LogChunk(seq, seq * 5, log)], wall_offset=draw(st.just(1.7e9) | numbers),
        telemetry=wire.Telemetry(time=draw(st.just(1.8e9) | numbers), host=host),
        why=wire.Why(stack_hz=draw(finite | numbers)),
    )  # fmt: skip


def test_fuzzed_batches_never_crash_a_monitor(tmp_path: Path) -> None:
    """Hypothesis-made batches (NaN, inf, huge numbers in step times, offsets, telemetry) on a
    real stream: the client rejects the bad ones at decode and counts them; the report and the
    exporter's figures over what it kept never raise."""
    from torchtop.monitor.diagnosis.report import run_report
    from torchtop.monitor.export.figures import samples
    from torchtop.monitor.model.state import RunState

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    address = f"ipc://{tmp_path}/fuzz.pub"
    pub.bind(address)
    client = AgentClient(Endpoint(f"ipc://{tmp_path}/none.req", address))
    state = RunState()
    sent = {"n": 0}

    def take(timeout: float) -> None:
        for got in client.recv_batches(timeout):
            if got.batch.run_id != PROBE:
                state.apply_batch(got.batch, got.steps, time.monotonic(), got.log_errors)

    try:
        # the subscription reaches the publisher (PUB drops what it sends before): probes until
        # one arrives, then the rest read off (one that comes later still is not counted)
        deadline = time.monotonic() + 60
        probe = wire.encode(wire.Batch(v=V, run_id=PROBE, seq=0, time=1.8e9))
        pub.send(probe)
        while not client.recv_batches(0.2):
            assert time.monotonic() < deadline, "the subscription never reached the publisher"
            pub.send(probe)
        while client.recv_batches(0.3):
            pass

        @seed(26)
        @settings(FUZZ, max_examples=150)
        @given(batch=hostile_batches())
        def publish(batch: wire.Batch) -> None:
            batch.seq = batch.log[0].seq = sent["n"]
            sent["n"] += 1
            pub.send(wire.encode(batch))
            take(1.0)
            report = run_report(state, 5.0)
            samples(report, "fuzz", "host", 0, True, 0, 0.0)

        publish()
        deadline = time.monotonic() + 30  # the last ones, where a loaded machine delivers them late
        while client.bad_frames + state.batches < sent["n"] and time.monotonic() < deadline:
            take(0.5)
    finally:
        client.close()
        ctx.destroy(linger=0)
    assert sent["n"] == 150 and client.bad_frames > 10 and state.batches > 10
    assert client.bad_frames + state.batches == sent["n"]  # each one taken or counted, none lost
