"""A training job run as a user would (a demo, or a script under TORCHTOP=1) and judged with
`torchtop report`: shared by the end-to-end verdict tests (test_scenarios, test_user_loops).

The job's output is read as it comes, so a test waits for the job's own progress ("step 60",
"warm") instead of for a fixed time: on a loaded machine a step can take a second.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any

SEVERE = ("warning", "critical")


def end_torchrun(proc: subprocess.Popen[bytes]) -> None:
    """End a torchrun job started in its own session: SIGTERM to the launcher (it passes it on to
    the ranks), and its whole process group killed if it has not ended in 30 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def report(pid: int, seconds: float, *extra: str) -> dict[str, Any]:
    """`torchtop report PID --seconds S [extra]`, parsed, once the agent of `pid` is listed: a
    zero-code agent is listed when the agent thread first sees the model run, which on a loaded
    machine can come after the loop has printed its progress."""
    wait_listed(pid)
    cmd = [
        sys.executable,
        "-m",
        "torchtop.monitor.commands.cli",
        "report",
        str(pid),
        "--seconds",
        str(seconds),
    ]
    out = subprocess.run([*cmd, *extra], capture_output=True, text=True, timeout=seconds + 90)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def wait_listed(pid: int, timeout: float = 60.0) -> None:
    from torchtop.contract import discovery

    deadline = time.monotonic() + timeout
    while not any(a.pid == pid for a in discovery.list_agents()):
        assert time.monotonic() < deadline, f"pid {pid} not listed as an agent after {timeout} s"
        time.sleep(0.1)


def wait_stepping(world_size: int, steps: int = 20, timeout: float = 120.0) -> None:
    """Until every listed rank of a job of `world_size` holds `steps` steps in its agent's history:
    the job past its start-up (the process group, its first collectives), which a loaded machine
    can stretch past any fixed sleep before a report."""
    from torchtop.contract import discovery
    from torchtop.monitor.link.client import AgentClient, AgentUnreachable
    from torchtop.monitor.link.targets import from_discovery

    deadline = time.monotonic() + timeout
    for agent in [a for a in discovery.list_agents() if a.world_size == world_size]:
        client = AgentClient(from_discovery(agent))
        try:
            while True:
                try:
                    got = len(client.snapshot(max_steps=steps, timeout=10.0).steps)
                except AgentUnreachable:  # a loaded machine: ask again
                    got = 0
                if got >= steps:
                    break
                assert time.monotonic() < deadline, f"rank {agent.rank}: {got} steps after {timeout} s"
                time.sleep(0.5)
        finally:
            client.close()


def flags(r: dict[str, Any]) -> dict[str, str]:
    return {f["kind"]: f["severity"] for f in r["flag_details"]}


def show(name: str, r: dict[str, Any]) -> None:
    print(
        f"\n{name}: {r['steps']} steps, median {r['step_time_ms']['median']:.1f} ms, "
        f"breakdown {r['breakdown']}\n  verdict {r['verdict']}\n  flags {r['flag_details']}"
    )


class Job:
    """A child process whose output lines are collected as they come."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_for(self, pattern: str, timeout: float = 300.0) -> re.Match[str]:
        """The first output line matching `pattern` (a regex), waiting up to `timeout` s for it."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            found = next((m for m in map(rx.search, list(self.lines)) if m is not None), None)
            if found is not None:
                return found
            self._alive(pattern)
            assert time.monotonic() < deadline, f"no {pattern!r} after {timeout} s: {self.lines[-20:]}"
            time.sleep(0.2)

    def wait_for_step(self, n: int, timeout: float = 300.0) -> None:
        """Until the job printed "step K" with K >= n (the demos' loss line, with --log-every)."""
        rx = re.compile(r"^step\s+(\d+)\b")
        deadline = time.monotonic() + timeout
        while max((int(m.group(1)) for m in map(rx.search, list(self.lines)) if m), default=-1) < n:
            self._alive(f"step {n}")
            assert time.monotonic() < deadline, f"not at step {n} after {timeout} s: {self.lines[-5:]}"
            time.sleep(0.3)

    def _alive(self, waiting_for: str) -> None:
        if self.proc.poll() is not None:
            self._reader.join(5)
            raise AssertionError(f"exited {self.proc.returncode} before {waiting_for!r}: {self.lines[-20:]}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
