"""A monitor attached to a benchmark's agent the way the TUI attaches, and its proof of receipt.

    python tests/benchmarks/attached.py PID     (the subscriber; benchmarks start it with `Monitor`)

A benchmark that reports a figure "with a monitor attached" must have had one: the subscriber
finds the agent by pid in this user's discovery files (`targets.parse`, as `torchtop attach PID`
does: ipc or TCP with the CURVE keys the entry holds), says hello, takes a snapshot and then
reads the batch stream with the monitor's own client (`AgentClient`), replaying every log chunk
into steps. It prints one JSON line when its first batch arrived and one with its counts when
told to stop (SIGTERM). `Monitor.finish` fails the run (SystemExit) unless it received every step
the agent cut while it watched.

The subscriber is not the training process's child, as a real monitor is not: a child is
sampled every second as a DataLoader worker would be, which a real attach does not cost. It is
started through a launcher that forks it and exits (`--detach`), so it belongs to init.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

READY_TIMEOUT_S = 60.0  # start-up of a Python process importing the monitor, on a loaded machine
FLUSH_S = 2.5  # two ticks at the slowest watched rate (1 Hz) and margin: the last step is sent and replayed


@dataclass
class Received:
    batches: int = 0
    steps: int = 0  # steps replayed from the batches' log chunks
    seq_gaps: int = 0  # batches missing from the stream (numbers skipped)
    bad_frames: int = 0
    transport: str = ""


class Monitor:
    """The subscriber process. `start` returns once it has received a batch (else SystemExit)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.proc: subprocess.Popen[str] | None = None  # the launcher; its pipe is the subscriber's
        self.subscriber = 0  # the subscriber's pid (not our child)
        self.transport = ""

    def start(self, timeout: float = READY_TIMEOUT_S) -> Monitor:
        here = os.path.abspath(__file__)
        self.proc = subprocess.Popen(
            [sys.executable, here, "--detach", str(self.pid)], stdout=subprocess.PIPE, text=True, bufsize=1
        )
        try:
            self.subscriber = int(json.loads(_read_line(self.proc, timeout) or "{}").get("pid", 0))
        except (ValueError, AttributeError):
            self.subscriber = 0
        self.proc.wait()  # the launcher exits at once: the subscriber is init's child now
        line = _read_line(self.proc, timeout) if self.subscriber else ""
        try:
            ready = json.loads(line)
        except ValueError:
            ready = {}
        if "ready" not in ready:
            self.kill()
            raise SystemExit(
                f"the monitor did not attach to pid {self.pid} ({line.strip() or 'no answer'}): "
                "no figure about an attached run can come of this"
            )
        self.transport = ready["ready"]
        return self

    def finish(self, expected_steps: int) -> Received:
        """Stop the subscriber and check it received `expected_steps` steps at least (SystemExit
        if not: the run measured an unwatched agent)."""
        got = self.stop()
        if got is None or got.steps < expected_steps or got.batches == 0:
            have = "nothing" if got is None else f"{got.steps} steps in {got.batches} batches"
            raise SystemExit(
                f"the monitor received {have} of the {expected_steps} steps the agent cut while it "
                "watched: this run measured an unwatched agent, its figure is void"
            )
        return got

    def stop(self) -> Received | None:
        proc = self.proc
        if proc is None:
            return None
        time.sleep(FLUSH_S)
        _signal(self.subscriber, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()
            return None
        self.proc = None
        for line in reversed(out.splitlines()):
            try:
                data = json.loads(line)
            except ValueError:
                continue
            if "batches" in data:
                return Received(**data)
        return None

    def kill(self) -> None:
        _signal(self.subscriber, signal.SIGKILL)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


def _signal(pid: int, sig: int) -> None:
    """`sig` to the subscriber if it still runs (init reaps it: no zombie to wait for)."""
    if pid > 0:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def _detach(pid: int) -> int:
    """The launcher: fork the subscriber, say its pid, exit (it is reparented to init)."""
    child = os.fork()
    if child:
        print(json.dumps({"pid": child}), flush=True)
        os._exit(0)
    os.setsid()
    return subscribe(pid)


def _read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    """The subscriber's first line, or "" when none comes in time (or it died)."""
    import selectors

    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        if not sel.select(timeout):
            return ""
        return proc.stdout.readline()
    finally:
        sel.close()


def subscribe(pid: int) -> int:
    """The subscriber's body: the TUI's attach (feed.py: hello, snapshot, stream) on `pid`."""
    from torchtop.monitor.link.client import AgentClient, AgentUnreachable
    from torchtop.monitor.link.targets import TargetError, parse

    stop = [False]
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__(0, True))
    deadline = time.monotonic() + READY_TIMEOUT_S
    try:
        endpoint = parse(str(pid))
        client = AgentClient(endpoint)
        client.hello(timeout=10)
    except (TargetError, AgentUnreachable) as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return 1
    client.snapshot(max_steps=10)  # as the TUI does; its steps are from before the watch
    got = Received(transport=endpoint.transport)
    last_seq = None
    while not stop[0]:
        for r in client.recv_batches(0.1):
            if got.batches == 0:
                print(json.dumps({"ready": endpoint.transport}), flush=True)
            got.batches += 1
            got.steps += len(r.steps)
            if last_seq is not None and r.batch.seq > last_seq + 1:
                got.seq_gaps += r.batch.seq - last_seq - 1
            last_seq = r.batch.seq
        if got.batches == 0 and time.monotonic() > deadline:
            print(json.dumps({"error": "no batch on the stream"}), flush=True)
            return 1
    got.bad_frames = client.bad_frames
    client.close()
    print(json.dumps(got.__dict__), flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "--detach":
        sys.exit(_detach(int(sys.argv[2])))
    sys.exit(subscribe(int(sys.argv[1])))
