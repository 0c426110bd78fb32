"""Nobody else on the machine gets in, and nothing is written where someone else points (issue 17).

A second local user is simulated with `setpriv` as `nobody` (the tests run as root; without root
or setpriv they skip, saying so). The run lives under a world-traversable directory, so that
only torchtop's own permissions stand between that user and the run: its sockets (ipc by
default, CURVE TCP when a port is asked for), its capture directory, its runtime directory.
Also here: capture files are new 0600 files never written through a link, `torchtop run` passes
SIGTERM, SIGHUP and SIGINT on to the job, and an error reply does not echo a huge command.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import termios
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

import torchtop.agent as ta
from tests.agent_util import client_for, free_port_pair
from torchtop.agent.capture import files
from torchtop.contract import discovery
from torchtop.monitor.link.client import AgentClient
from torchtop.monitor.link.targets import from_discovery
from torchtop.monitor.model.captures import describe

torch = pytest.importorskip("torch")
from remote_util import training_agent  # noqa: E402

NOBODY = 65534
SETPRIV = shutil.which("setpriv")
second_user = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0 or SETPRIV is None,
    reason="acting as a second local user needs root and setpriv (util-linux); run the tests as root",
)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def as_nobody(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run Python `code` as the user nobody (no groups), from /, with a bare environment."""
    assert SETPRIV is not None
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/", "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [SETPRIV, "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable, "-c", code, *args]
    return subprocess.run(cmd, env=env, cwd="/", capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def shared(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A world-traversable directory (pytest's own tmp is 0700: it would hide everything from
    the other user by itself). The runtime directory is its `rt`."""
    base = Path(tempfile.mkdtemp(prefix="torchtop-sec-", dir="/tmp"))
    os.chmod(base, 0o755)
    monkeypatch.setenv("TORCHTOP_RUNTIME_DIR", str(base / "rt"))
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


# -- the other user against a run's sockets ------------------------------------------------------
INTRUDER = r"""
import json, socket, sys, zmq
request, stream, server_key = sys.argv[1], sys.argv[2], sys.argv[3]
from torchtop.contract import wire
out = {"raw_connect": False, "hello": False, "batch": False, "capture": False}
path = request.removeprefix("ipc://")
try:  # the plain socket first: file permissions are what refuse it on ipc
    if request.startswith("ipc://"):
        s = socket.socket(socket.AF_UNIX); s.settimeout(2); s.connect(path); s.close()
    else:
        host, port = request.removeprefix("tcp://").rsplit(":", 1)
        socket.create_connection((host, int(port)), timeout=2).close()
    out["raw_connect"] = True
except OSError as exc:
    out["raw_error"] = type(exc).__name__
ctx = zmq.Context()
tries = [None] + ([zmq.curve_keypair()] if server_key else [])  # no key, then a key of its own
for keys in tries:
    def sock(kind, address):
        s = ctx.socket(kind); s.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            s.curve_serverkey, s.curve_publickey, s.curve_secretkey = server_key.encode(), keys[0], keys[1]
        s.connect(address); return s
    sub = sock(zmq.SUB, stream); sub.setsockopt(zmq.SUBSCRIBE, b"")
    dealer = sock(zmq.DEALER, request)
    for name, cmd, args in (("hello", "hello", {}), ("capture", "capture-profile", {"steps": 2})):
        frame = wire.encode(wire.Request(v=wire.PROTOCOL_VERSION, id=1, cmd=cmd, args=args))
        if dealer.poll(2000, zmq.POLLOUT):  # no pipe at all (a refused handshake): nothing to send on
            dealer.send(frame, zmq.NOBLOCK)
            if dealer.poll(3000):
                out[name] = True
                dealer.recv()
    if sub.poll(2000):
        out["batch"] = True
print(json.dumps(out), flush=True)
import os; os._exit(0)
"""


@second_user
@pytest.mark.slow
@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_another_user_can_neither_read_a_run_nor_trigger_anything(
    transport: str, shared: Path, subprocess_env: dict[str, str]
) -> None:
    env = dict(subprocess_env, TORCHTOP_RUNTIME_DIR=str(shared / "rt"))
    if transport == "tcp":  # TCP only when asked for: then CURVE, whatever the other user tries
        env["TORCHTOP_PORT"] = str(free_port_pair())
    work = shared / "work"
    work.mkdir()
    with training_agent(work, env) as (proc, info):
        port = info.port or 0
        request = info.address or f"tcp://127.0.0.1:{port}"  # (an entry of before issue 17)
        stream = info.pub_address or f"tcp://127.0.0.1:{port + 1}"
        ours = AgentClient(from_discovery(info))  # the same user, through its discovery entry: welcome
        try:
            assert ours.hello(timeout=10).pid == proc.pid
        finally:
            ours.close()

        out = as_nobody(INTRUDER, request, stream, info.server_key or "")
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout)
        assert not got["hello"] and not got["batch"] and not got["capture"], got
        assert request.startswith(f"{transport}://")
        if transport == "ipc":
            assert not got["raw_connect"] and got["raw_error"] == "PermissionError", got
            assert mode(shared / "rt") == 0o700
            for path in (request, stream):
                assert mode(Path(path.removeprefix("ipc://"))) == 0o600
        ours = AgentClient(from_discovery(info))
        try:  # nothing they sent started a capture
            assert ours.request("capture-status", timeout=10).captures == []
        finally:
            ours.close()


# -- capture files -------------------------------------------------------------------------------
class Loop:
    """A training loop on this (the training) thread."""

    def __init__(self) -> None:
        self.model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.x = torch.randn(16, 32)

    def until(self, cond, timeout: float = 60) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, "timed out"
            self.model(self.x).sum().backward()
            self.opt.step()
            self.opt.zero_grad()
            time.sleep(0.002)


def capture_profile(agent) -> tuple:  # type: ignore[no-untyped-def]
    """Ask for a 2-step profile as this user's monitor would; (reply, finished capture)."""
    client = client_for(agent)
    box: dict = {}
    asker = threading.Thread(target=lambda: box.update(r=client.request("capture-profile", {"steps": 2}, 10)))
    asker.start()
    loop = Loop()
    loop.until(lambda: "r" in box)
    asker.join()
    client.close()
    reply = box["r"]
    assert reply.ok, reply.error
    loop.until(lambda: agent.captures.current.state in ("done", "failed"))
    return reply, agent.captures.current


def predicted_names(pid: int, ids: range = range(1, 4), ahead_s: int = 120) -> list[str]:
    """The names a capture of this process would get in the next two minutes (before issue 17
    the only names it tried)."""
    now = time.time()
    stamps = {time.strftime("%Y%m%d-%H%M%S", time.localtime(now + d)) for d in range(-5, ahead_s)}
    return [f"profile-{pid}-{s}-{i}.pt.trace.json.gz" for s in sorted(stamps) for i in ids]


PLANT = r"""
import os, sys
directory, victim, names = sys.argv[1], sys.argv[2], sys.argv[3:]
os.mkdir(directory, 0o777); os.chmod(directory, 0o777)
for name in names:
    os.symlink(victim, os.path.join(directory, name))
"""


@second_user
@pytest.mark.slow
def test_a_capture_never_overwrites_through_another_users_planted_links(
    shared: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The attack of the issue: another user who can write to the run's working directory makes
    ./torchtop-captures and plants links with the coming names to a file of the training user."""
    work = shared / "work"
    work.mkdir()
    os.chmod(work, 0o777)  # a working directory others can write to (a shared project dir)
    victim = shared / "precious"
    victim.write_bytes(b"root's own 0600 file")
    os.chmod(victim, 0o600)
    planted = work / "torchtop-captures"
    out = as_nobody(PLANT, str(planted), str(victim), *predicted_names(os.getpid()))
    assert out.returncode == 0, out.stderr
    assert planted.stat().st_uid == NOBODY
    monkeypatch.chdir(work)
    monkeypatch.delenv("TORCHTOP_DIR", raising=False)
    agent = ta.start()
    assert agent is not None
    capfd.readouterr()

    reply, cap = capture_profile(agent)
    assert cap.state == "done", cap.error
    assert victim.read_bytes() == b"root's own 0600 file" and mode(victim) == 0o600
    assert all(p.is_symlink() for p in planted.iterdir())  # nothing written into their directory
    fallback = shared / "rt" / "captures"
    path = Path(cap.path)
    assert path.parent == fallback and mode(path) == 0o600 and mode(fallback) == 0o700
    # where the files went, and why: in the reply, in the capture, and once on stderr
    for note in (reply.capture.note, cap.note):
        assert str(fallback) in note and str(planted) in note and "another user" in note, note
    assert f"note: {cap.note}" in describe(cap)  # what `torchtop capture` and the Captures screen show

    def about_captures(err: str) -> list[str]:  # the profiler and other notices print lines of their own
        return [line for line in err.splitlines() if line.startswith("torchtop:") and "capture" in line]

    ours = about_captures(capfd.readouterr().err)
    assert len(ours) == 1 and str(fallback) in ours[0], ours
    reply, cap = capture_profile(agent)  # warned once, said every time
    assert str(fallback) in cap.note and about_captures(capfd.readouterr().err) == []


def test_capture_files_are_new_0600_files_never_written_through_a_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Even in a directory of ours, a link with the coming name is never followed: another name."""
    captures = tmp_path / "captures"
    captures.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    for name in predicted_names(os.getpid()):
        (captures / name).symlink_to(victim)
    monkeypatch.setenv("TORCHTOP_DIR", str(captures))
    agent = ta.start()
    assert agent is not None
    _, cap = capture_profile(agent)
    assert cap.state == "done", cap.error
    assert victim.read_bytes() == b"keep me"
    path = Path(cap.path)
    assert path.parent == captures and not path.is_symlink() and mode(path) == 0o600
    assert cap.note == ""  # the directory asked for was used
    assert not list(captures.glob(".torchtop-*"))  # the export's private temp directory is gone

    dest = files.open_destination(captures)  # the memory snapshot's way: an exclusive create
    try:
        (captures / "memory-1.memory.pickle").symlink_to(victim)
        made, fd = files.create(dest, "memory-1", ".memory.pickle")
        os.close(fd)
        assert made.name != "memory-1.memory.pickle" and mode(made) == 0o600
    finally:
        dest.close()
    assert victim.read_bytes() == b"keep me"


@pytest.mark.parametrize("why", ["group-writable", "symlink"])
def test_a_capture_directory_others_can_write_or_a_link_is_refused(
    why: str, tmp_path: Path, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wanted = tmp_path / "captures"
    if why == "symlink":
        real = tmp_path / "real"
        real.mkdir(mode=0o700)
        wanted.symlink_to(real)
    else:
        wanted.mkdir()
        os.chmod(wanted, 0o775)
    dest = files.open_destination(wanted)
    try:
        assert dest.path == runtime_dir / "captures" and str(wanted) in dest.note
        assert ("symlink" if why == "symlink" else "written by other users") in dest.note
    finally:
        dest.close()


# -- the runtime directory -----------------------------------------------------------------------
LINK = r"""
import os, sys
os.symlink(sys.argv[1], sys.argv[2])
"""


@second_user
def test_a_runtime_dir_through_another_users_symlink_is_refused(
    shared: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    victims = shared / "victims-dir"  # a directory of the training user's, readable by all
    victims.mkdir(mode=0o755)
    os.chmod(victims, 0o755)
    (victims / "notes.txt").write_text("mine")
    drop = shared / "drop"  # where the other user may create things, like /tmp
    drop.mkdir()
    os.chmod(drop, 0o1777)
    link = drop / "torchtop-rt"
    out = as_nobody(LINK, str(victims), str(link))
    assert out.returncode == 0, out.stderr
    assert link.lstat().st_uid == NOBODY
    monkeypatch.setenv("TORCHTOP_RUNTIME_DIR", str(link))

    agent = ta.start()
    assert agent is not None  # training goes on, observed through sockets elsewhere
    assert mode(victims) == 0o755 and sorted(p.name for p in victims.iterdir()) == ["notes.txt"]
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "symlink owned by another user" in err[0], err
    assert f"torchtop attach {agent.sockets.address}" in err[0]
    assert not agent.sockets.address.startswith(f"ipc://{link}")
    assert discovery.list_agents() == []  # nor read through their link
    client = client_for(agent)
    try:
        assert client.hello(timeout=10).pid == os.getpid()
    finally:
        client.close()


def test_our_own_symlink_is_followed_and_the_target_checked(tmp_path: Path, monkeypatch) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o755)
    (tmp_path / "link").symlink_to(real)
    monkeypatch.setenv("TORCHTOP_RUNTIME_DIR", str(tmp_path / "link"))
    path = discovery.write(discovery.AgentInfo(pid=os.getpid(), port=1))
    assert mode(real) == 0o700 and (real / path.name).is_file()  # ours: narrowed, written into


def test_discovery_file_is_never_written_through_a_planted_link(runtime_dir: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    pid = os.getpid()
    for name in (f".agent-{pid}.json.tmp", f"agent-{pid}.json"):  # the old temp name, the final one
        (runtime_dir / name).symlink_to(victim)
    path = discovery.write(discovery.AgentInfo(pid=pid, port=1))
    assert victim.read_text() == "keep me"
    assert not path.is_symlink() and mode(path) == 0o600 and json.loads(path.read_text())["pid"] == pid


# -- error replies -------------------------------------------------------------------------------
def test_an_unknown_command_is_not_echoed_whole(agent) -> None:
    client = client_for(agent)
    try:
        reply = client.request("x" * 500_000, timeout=10)
    finally:
        client.close()
    assert not reply.ok and reply.error.startswith("unknown command 'xxx") and len(reply.error) < 120


# -- torchtop run passes signals on --------------------------------------------------------------
JOB = textwrap.dedent(
    """
    import signal, sys, time, torch
    count, first = 0, None
    def interrupted(signum, frame):
        global count, first
        count += 1
        first = first or time.monotonic()
    if sys.argv[1] == "count":  # count SIGINTs; exit 7 a second after the first
        signal.signal(signal.SIGINT, interrupted)
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    print("ready", flush=True)
    end = time.monotonic() + 120
    while time.monotonic() < end:
        model(torch.randn(8, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
        time.sleep(0.01)
        if first is not None and time.monotonic() > first + 1.0:
            print(f"sigints {count}", flush=True)
            sys.exit(7)
    """
)


def _run_cmd(script: Path, *run_args: str, mode_: str = "plain") -> list[str]:
    return [
        sys.executable,
        "-m",
        "torchtop.monitor.commands.cli",
        "run",
        *run_args,
        "--",
        sys.executable,
        str(script),
        mode_,
    ]


def _job_agent(launcher: subprocess.Popen, timeout: float = 90) -> discovery.AgentInfo:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert launcher.poll() is None, "the launcher exited"
        agents = discovery.list_agents()
        if agents:
            return agents[0]
        time.sleep(0.1)
    raise AssertionError("the job's agent never showed up")


def _gone(pid: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_run_passes_signals_on_to_the_job_and_returns_its_status(signum: int, tmp_path: Path) -> None:
    """What a scheduler does: signal the launcher (only). The job gets it, ends, and its status
    comes back; no orphan is left for `torchtop ls` to list."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    launcher = subprocess.Popen(
        _run_cmd(script, "--no-tui"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    job_pid = None
    try:
        job_pid = _job_agent(launcher).pid
        os.kill(launcher.pid, signum)
        _, err = launcher.communicate(timeout=60)
        assert launcher.returncode == 128 + signum, (launcher.returncode, err[-2000:])
        assert job_pid is not None and _gone(job_pid)
        assert discovery.list_agents() == []
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        if job_pid is not None and psutil.pid_exists(job_pid):
            os.kill(job_pid, signal.SIGKILL)


class Terminal:
    """A pseudo-terminal that a child takes as its controlling terminal; its output drained."""

    def __init__(self) -> None:
        self.master, self.slave = pty.openpty()
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        self.output = bytearray()
        self._reader = threading.Thread(target=self._read, daemon=True)

    def spawn(self, cmd: list[str]) -> subprocess.Popen:
        def take_terminal() -> None:  # in the child: a new session whose terminal this is
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        proc = subprocess.Popen(
            cmd,
            stdin=self.slave,
            stdout=self.slave,
            stderr=self.slave,
            start_new_session=True,
            preexec_fn=take_terminal,
            env=dict(os.environ, TERM="xterm-256color"),
        )
        os.close(self.slave)
        self._reader.start()
        return proc

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:
                return
            if not data:
                return
            self.output += data

    def wait_for(self, text: bytes, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output:
            assert time.monotonic() < deadline, bytes(self.output[-2000:])
            time.sleep(0.05)

    def close(self) -> None:
        os.close(self.master)


@pytest.mark.slow
def test_ctrl_c_at_the_terminal_reaches_the_job_once(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    term = Terminal()
    launcher = term.spawn(_run_cmd(script, "--no-tui", mode_="count"))
    try:
        term.wait_for(b"ready")
        time.sleep(0.5)
        os.write(term.master, b"\x03")  # Ctrl-C, as typed
        assert launcher.wait(60) == 7  # the job's own exit code
        term.wait_for(b"sigints 1", timeout=5)
        assert b"sigints 2" not in term.output
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        term.close()


@pytest.mark.slow
def test_run_with_the_tui_passes_sigterm_on_and_closes(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    term = Terminal()
    launcher = term.spawn(_run_cmd(script, "--log-dir", str(tmp_path / "logs")))
    job_pid = None
    try:
        job_pid = _job_agent(launcher).pid
        time.sleep(3)  # the TUI is up (settle 2 s after the agent showed)
        os.kill(launcher.pid, signal.SIGTERM)
        assert launcher.wait(60) == 128 + signal.SIGTERM, bytes(term.output[-2000:])
        assert job_pid is not None and _gone(job_pid)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        if job_pid is not None and psutil.pid_exists(job_pid):
            os.kill(job_pid, signal.SIGKILL)
        term.close()
