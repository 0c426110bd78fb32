"""What idle peers and killed agents leave behind (issue 26, item 11): the exporter times idle
connections out (and caps them), so they hold no thread; `torchtop ls` removes the socket files of
a SIGKILLed agent, and nothing else."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.agent_util import free_port
from torchtop.contract import discovery


@pytest.mark.export
@pytest.mark.slow  # among the fast subset's slowest, ~1.6 s here (issue 27: the subset under 60 s)
def test_idle_exporter_connections_time_out_and_are_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("prometheus_client")
    from torchtop.monitor.export import prometheus
    from torchtop.monitor.export.figures import SampleBoard

    monkeypatch.setattr(prometheus, "IDLE_TIMEOUT_S", 1.0)
    monkeypatch.setattr(prometheus, "MAX_CONNECTIONS", 20)
    port = free_port()

    def handlers() -> int:  # the threads that serve a connection (socketserver's, by its method's name)
        return sum("process_request_thread" in t.name for t in threading.enumerate())

    before = handlers()  # other tests' threads come and go: only connection threads are counted
    server, _ = prometheus.serve(SampleBoard(), port)
    try:
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(60)]
        time.sleep(0.5)
        held = handlers() - before
        assert 0 < held <= 20, f"{held} threads for idle connections"
        status, deadline = None, time.monotonic() + 10
        while status is None and time.monotonic() < deadline:  # once the idle ones time out (1 s)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    status = r.status
            except (OSError, http.client.HTTPException):  # still full: closed at once
                time.sleep(0.2)
        assert status == 200, "a scrape never got a slot back from the idle connections"
        deadline = time.monotonic() + 10
        while handlers() > before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert handlers() <= before, "idle connections still hold threads"
        for s in idle:
            s.close()
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.slow  # among the fast subset's slowest, ~1.4 s here (issue 27: the subset under 60 s)
def test_ls_removes_a_killed_agents_socket_files_only(
    runtime_dir: Path, subprocess_env: dict[str, str]
) -> None:
    code = "import time, torchtop.agent as ta; ta.start(); print('up', flush=True); time.sleep(60)"
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=subprocess_env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        files = {p.name for p in runtime_dir.iterdir()}
        assert {f"agent-{proc.pid}.req", f"agent-{proc.pid}.pub", f"agent-{proc.pid}.json"} <= files
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    # a live process's socket and a plain file of that name stay
    live = runtime_dir / f"agent-{os.getpid()}.req"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(live))
    plain = runtime_dir / "agent-4194999.pub"
    plain.write_text("not a socket")
    assert discovery.list_agents() == []
    left = {p.name for p in runtime_dir.iterdir()}
    assert not any(n.startswith(f"agent-{proc.pid}.") for n in left), left
    assert {live.name, plain.name} <= left
    sock.close()
