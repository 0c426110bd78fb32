"""What a heavy or hostile load on the agent's sockets does to training and to real monitors
(issue 17): a frame bomb, a request flood. Real training in a child process, real sockets, the
attacks made in advance and sent as raw ZMTP bytes (tests/load_util.py); assertions are ratios
and bounds of about a tick, never a machine's speed.
"""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest
import zmq

from tests.agent_util import median
from tests.load_util import RawPeer, Watcher, empty_frames, request
from tests.remote_util import training_agent
from torchtop.contract import wire
from torchtop.monitor.link.targets import from_discovery

pytest.importorskip("torch")
pytestmark = pytest.mark.slow

MB = 1 << 20


def test_a_frame_bomb_costs_training_nothing_and_is_never_echoed(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """Twelve requests of 100,000 empty frames each (the issue's bomb was 3 million): read off a
    frame at a time within the agent's budget, never kept whole, never echoed; the sender is
    ignored. Training keeps its pace and the agent keeps publishing it."""
    with training_agent(tmp_path, subprocess_env) as (proc, info):
        endpoint = from_discovery(info)
        watcher = Watcher(endpoint)
        watcher.start()
        try:
            watcher.wait_steps(500)
            rss = psutil.Process(proc.pid).memory_info().rss
            start = time.time()
            time.sleep(4.0)
            quiet_window = (start, time.time())
            bomber = RawPeer(endpoint.address, empty_frames(100_000) * 12)
            bomber.start()
            start = time.time()
            peak = rss
            while time.time() - start < 8.0:
                peak = max(peak, psutil.Process(proc.pid).memory_info().rss)
                time.sleep(0.1)
            bomb_window = (start, time.time())
            assert proc.poll() is None, "the training process died"
            watcher.wait_until(bomb_window[1] + 0.5)  # the steps of the bomb window, published
            bomber.halt.set()
            bomber.join(5)
        finally:
            watcher.halt.set()
            watcher.join(5)
        quiet, bombed = watcher.between(*quiet_window), watcher.between(*bomb_window)
        ratio = median(bombed) / median(quiet)
        rate = (
            len(bombed)
            / (bomb_window[1] - bomb_window[0])
            / (len(quiet) / (quiet_window[1] - quiet_window[0]))
        )
        print(
            f"\nbomb: RSS {rss / MB:.0f} MB -> peak {peak / MB:.0f} MB; median step {median(quiet):.3f} ms "
            f"quiet ({len(quiet)} steps), {median(bombed):.3f} ms bombed ({len(bombed)} steps): x{ratio:.2f}, "
            f"steps/s x{rate:.2f}; {bomber.received} bytes came back"
        )
        # 12 bombs held whole by the socket are ~75 MB, echoed ~75 MB more: at most ~5 may wait
        # in the socket at a time (its RCVHWM), ~6 MB each until read off
        assert peak - rss < 50 * MB, f"the training process grew {(peak - rss) / MB:.0f} MB"
        assert ratio < 1.3, f"the training loop's steps took x{ratio:.2f} as long under the bomb"
        assert rate > 0.5, f"the training loop made x{rate:.2f} the steps per second under the bomb"
        assert bomber.received < 4096, f"{bomber.received} bytes came back to the bomber"  # no echo


def hello_latencies(address: str, count: int) -> list[float]:
    """Seconds each of `count` hellos took, one after the other, from a bare DEALER (no stream
    subscription: the agent stays at its quiet tick rate)."""
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(address)
    out = []
    try:
        for k in range(count):
            t = time.perf_counter()
            dealer.send(wire.encode(wire.Request(v=wire.PROTOCOL_VERSION, id=k, cmd="hello")))
            assert dealer.poll(10_000), f"hello {k} was never answered"
            reply = wire.decode(dealer.recv())
            assert isinstance(reply, wire.Reply) and reply.ok and reply.id == k and reply.hello is not None
            out.append(time.perf_counter() - t)
    finally:
        dealer.close()
    return out


def test_a_monitor_is_answered_within_a_tick_while_others_flood(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """Four clients pipeline hellos as fast as the agent takes them; a monitor's own hellos are
    still answered within about a tick (0.1 s), not after the flood's queue, and each flooder
    gets its share (ZeroMQ reads peers round-robin; a peer's excess over its share is dropped)."""
    with training_agent(tmp_path, subprocess_env) as (proc, info):
        address = from_discovery(info).address
        quiet = hello_latencies(address, 10)
        flooders = [RawPeer(address, request("hello") * 200_000) for _ in range(4)]
        for f in flooders:
            f.start()
        try:
            time.sleep(1.0)
            flooded = hello_latencies(address, 40)
            answered = [f.received for f in flooders]
        finally:
            for f in flooders:
                f.halt.set()
        assert proc.poll() is None
    flooded.sort()
    print(
        f"\nflood: hello median {median(quiet) * 1e3:.1f} ms quiet; during the flood median "
        f"{median(flooded) * 1e3:.1f} ms, p90 {flooded[35] * 1e3:.1f} ms, max {flooded[-1] * 1e3:.1f} ms; "
        f"flooders got {[b // 1000 for b in answered]} kB"
    )
    assert median(flooded) < 0.1 and flooded[35] < 0.25, "the monitor waited behind the flood"
    assert min(answered) > 10_000  # every flooder was answered too (~100 replies at least)
