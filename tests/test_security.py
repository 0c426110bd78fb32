"""Who may talk to an agent (issue 7): CURVE keys, refused binds, private discovery files, fuzzing.

Real sockets throughout: an in-process agent for the CURVE tests (its captures state is read
directly, to prove a wrong-key client's request never ran), a child training process for the
fuzz test (so the step times it measures are the training loop's own).
"""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.auth
from agent_util import median, raw_connection
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from remote_util import training_agent

import torchtop.agent as ta
from torchtop.contract import curve_keys, discovery, wire
from torchtop.monitor.commands import cli
from torchtop.monitor.commands import keys as keys_cli
from torchtop.monitor.link.client import AgentClient, AgentUnreachable
from torchtop.monitor.link.targets import Endpoint, from_discovery

pytest.importorskip("torch")


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# -- keys ----------------------------------------------------------------------------------------
@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty user config dir for this test (no key anywhere)."""
    directory = tmp_path / "config"
    monkeypatch.setenv(curve_keys.ENV_CONFIG, str(directory))
    for name in (curve_keys.ENV_SERVER_KEY, curve_keys.ENV_AUTHORIZED, curve_keys.ENV_CURVE):
        monkeypatch.delenv(name, raising=False)
    return directory


def test_keys_command_makes_private_key_files(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["keys"]) == 0
    out = capsys.readouterr().out
    kd = config / "keys"
    public, secret = kd / "client.key", kd / "client.key_secret"
    assert mode(kd) == 0o700 and mode(secret) == 0o600 and mode(public) == 0o644
    pub = zmq.auth.load_certificate(str(secret))
    assert pub[1] is not None and zmq.auth.load_certificate(str(public)) == (pub[0], None)
    assert pub[0].decode() in out and "authorized_keys" in out and "ssh://" in out

    assert cli.main(["keys"]) == 0  # kept, not replaced
    assert "existing" in capsys.readouterr().out and zmq.auth.load_certificate(str(secret)) == pub
    assert cli.main(["keys", "--force"]) == 0
    assert zmq.auth.load_certificate(str(secret)) != pub

    assert cli.main(["keys", "--server"]) == 0
    out = capsys.readouterr().out
    assert (
        mode(kd / "server.key_secret") == 0o600 and "TORCHTOP_BIND=0.0.0.0" in out and "--server-key" in out
    )

    assert cli.main(["keys", "--authorize", str(public), "--name", "alice"]) == 0
    allowed = zmq.auth.load_certificates(str(kd / "authorized_keys"))  # the format zmq.auth reads
    assert list(allowed) == [zmq.auth.load_certificate(str(public))[0]]
    assert mode(kd / "authorized_keys") == 0o700
    assert cli.main(["keys", "--authorize", str(secret)]) == 1  # never a secret key
    assert "secret" in capsys.readouterr().err


def test_non_loopback_bind_without_keys_is_refused(
    config: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert ta.start(bind="0.0.0.0") is None
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "torchtop keys --server" in err and "authorized_keys" in err and "ssh://" in err
    assert discovery.list_agents() == []

    keys_cli.make_pair("server")  # a server key but nobody allowed in: still refused
    assert ta.start(bind="0.0.0.0") is None
    err = capsys.readouterr().err
    assert "no authorized client keys" in err and str(config / "keys" / "authorized_keys") in err

    monkeypatch.setenv("TORCHTOP_BIND", "0.0.0.0")  # the env bind is held to the same rule
    assert ta.start() is None
    assert "without CURVE" in capsys.readouterr().err


@pytest.fixture
def curve_setup(tmp_path: Path, config: Path, monkeypatch: pytest.MonkeyPatch):
    """Server keys + one authorized client (in another config dir, like another machine)."""
    server_public = keys_cli.make_pair("server")[0]
    monitor_cfg = tmp_path / "monitor-config"
    monkeypatch.setenv(curve_keys.ENV_CONFIG, str(monitor_cfg))
    client_public = keys_cli.make_pair("client")[0]
    monkeypatch.setenv(curve_keys.ENV_CONFIG, str(config))
    keys_cli.authorize(str(client_public), "monitor")
    good_pub, good_sec = curve_keys.read_keypair(monitor_cfg / "keys" / "client.key_secret")
    spub = curve_keys.read_cert(server_public)[0]
    return {
        "server_key_file": server_public,
        "monitor_cfg": monitor_cfg,
        "good": curve_keys.ClientCurve(spub, good_pub, good_sec),
        "server_public": spub,
    }


def _stranger(server_public: bytes) -> curve_keys.ClientCurve:
    pub, sec = zmq.curve_keypair()
    return curve_keys.ClientCurve(server_public, pub, sec)


def _silent(endpoint: Endpoint, timeout: float = 0.5) -> None:
    """Nothing comes back to this client: no hello, no batch, and its capture request times out."""
    client = AgentClient(endpoint)
    try:
        with pytest.raises(AgentUnreachable):
            client.hello(timeout=timeout)
        assert client.recv_batches(timeout) == []
        with pytest.raises(AgentUnreachable):
            client.request("capture-profile", {"steps": 2}, timeout=timeout)
    finally:
        client.close()


@pytest.mark.slow  # subprocess clients
@pytest.mark.parametrize("bind", ["0.0.0.0", "127.0.0.1"])
def test_curve_agent_serves_only_authorized_keys(
    bind: str,
    curve_setup,
    runtime_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    if bind == "127.0.0.1":
        monkeypatch.setenv(curve_keys.ENV_CURVE, "1")  # CURVE on loopback: optional, on request
    agent = ta.start(bind=bind)
    assert agent is not None and agent.sockets.curve is not None, capsys.readouterr().err
    host, port, spub = "127.0.0.1", agent.port, curve_setup["server_public"]

    good = AgentClient(Endpoint.tcp(host, port, curve=curve_setup["good"]))
    try:
        assert good.hello(timeout=5).pid == os.getpid()
        deadline = time.monotonic() + 30  # the first batch at once when quiet; a loaded machine is slower
        while not good.recv_batches(0.5) and time.monotonic() < deadline:
            pass
        assert time.monotonic() < deadline, "an authorized client got no batch"
    finally:
        good.close()

    _silent(Endpoint.tcp(host, port))  # no key at all (NULL mechanism)
    _silent(Endpoint.tcp(host, port, curve=_stranger(spub)))  # a key the agent does not know
    wrong_server = curve_keys.ClientCurve(
        zmq.curve_keypair()[0], curve_setup["good"].public, curve_setup["good"].secret
    )
    _silent(Endpoint.tcp(host, port, curve=wrong_server))  # our key, but not this agent's
    time.sleep(0.3)
    assert agent.captures.current is None and agent.captures.status() == []  # nothing ran
    assert agent.loop.bad_requests == 0  # nothing they sent was even read

    # the CLI: tcp:// with --server-key and the client pair from the monitor's config dir
    monkeypatch.setenv(curve_keys.ENV_CONFIG, str(curve_setup["monitor_cfg"]))
    capsys.readouterr()
    target = f"tcp://{host}:{port}"
    report = _report_with_batches(
        capsys, ["report", target, "--server-key", str(curve_setup["server_key_file"]), "--seconds", "0.5"]
    )
    assert report["pid"] == os.getpid() and report["batches"] > 0
    # without the key (and without this user's discovery entry, which holds a key pair): nothing
    monkeypatch.setenv("TORCHTOP_RUNTIME_DIR", str(curve_setup["monitor_cfg"] / "elsewhere"))
    assert cli.main(["report", target, "--seconds", "0.5"]) == 2
    assert "no answer" in capsys.readouterr().err
    monkeypatch.setenv("TORCHTOP_RUNTIME_DIR", str(runtime_dir))
    # a local monitor finds the agent's public key in its discovery file
    assert discovery.list_agents()[0].server_key == spub.decode()
    assert _report_with_batches(capsys, ["report", str(os.getpid()), "--seconds", "0.5"])["batches"] > 0


def _report_with_batches(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict:
    """`torchtop report` (exit 0), asked again until it received a batch: its half second may end
    before the subscription's handshake is through and the agent's thread has sent, on a loaded
    machine (the agent shares this process's GIL); a client left without batches fails at the
    deadline."""
    deadline = time.monotonic() + 60
    while True:
        assert cli.main(argv) == 0, capsys.readouterr().err
        report = json.loads(capsys.readouterr().out)
        if report["batches"] > 0 or time.monotonic() > deadline:
            return report


def test_server_key_errors_are_one_line(
    curve_setup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        cli.main(
            ["report", "tcp://127.0.0.1:9", "--server-key", str(tmp_path / "nope.key"), "--seconds", "1"]
        )
        == 2
    )
    assert "cannot read the server key" in capsys.readouterr().err
    monkeypatch.setenv(curve_keys.ENV_CONFIG, str(tmp_path / "empty"))
    assert cli.main(["report", "tcp://127.0.0.1:9", "--server-key", str(curve_setup["server_key_file"])]) == 2
    assert "run `torchtop keys`" in capsys.readouterr().err


# -- discovery files -----------------------------------------------------------------------------
def test_discovery_dir_and_files_are_private(runtime_dir: Path) -> None:
    os.chmod(runtime_dir, 0o755)  # a wide directory is narrowed
    agent = ta.start()
    assert agent is not None
    path = runtime_dir / f"agent-{os.getpid()}.json"
    assert mode(runtime_dir) == 0o700 and mode(path) == 0o600
    ta.stop()
    if os.geteuid() != 0:
        return
    os.chown(runtime_dir, 65534, 65534)  # someone else's directory: refused, not written into
    try:
        with pytest.raises(PermissionError, match="belongs to another user"):
            discovery.write(discovery.AgentInfo(pid=os.getpid(), port=1))
    finally:
        os.chown(runtime_dir, 0, 0)


# -- fuzzing -------------------------------------------------------------------------------------
leaf = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
values = st.recursive(
    leaf,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
    max_leaves=12,
)
COMMANDS = ["hello", "ping", "snapshot", "capture-profile", "capture-memory", "capture-status"]


@st.composite
def bad_request(draw: st.DrawFn) -> bytes:
    """A request that looks valid but whose arguments are wrong (so no capture can start)."""
    cmd = draw(st.sampled_from(COMMANDS) | st.text(max_size=12))
    args = draw(st.dictionaries(st.text(max_size=8), values, max_size=4))
    if cmd.startswith("capture") or cmd == "snapshot":
        args["zz-" + draw(st.text(max_size=4))] = draw(values)  # unknown key: refused
        args["max_steps"] = draw(
            st.one_of(st.integers(-(2**63), 0), st.integers(10_001, 2**64 - 1), st.text(), st.floats())
        )
    msg = {
        "type": "request",
        "v": draw(st.sampled_from([wire.PROTOCOL_VERSION, 0, 2, -1])),
        "id": draw(leaf),
        "cmd": cmd,
        "args": args,
    }
    if draw(st.booleans()):
        del msg[draw(st.sampled_from(sorted(msg)))]
    return msgspec.msgpack.encode(msg)


random_map = st.dictionaries(st.text(max_size=8), values, max_size=6).map(msgspec.msgpack.encode)
frames = st.lists(st.binary(max_size=512) | random_map | bad_request(), min_size=1, max_size=4)
ZMTP = b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f\x03\x00"
raw_stream = st.binary(max_size=256) | st.binary(max_size=200).map(lambda b: ZMTP + b)
FUZZ = settings(max_examples=250, deadline=None, database=None, suppress_health_check=list(HealthCheck))  # pyright: ignore[reportArgumentType]  # hypothesis: its enum metaclass has an untyped __iter__


class Fuzzer:
    """Throws hypothesis-made frames at an agent's two sockets: as a zmq peer and as raw bytes
    (on TCP or the ipc socket files)."""

    def __init__(self, endpoint: Endpoint, curve: curve_keys.ClientCurve | None = None) -> None:
        self.addresses = (endpoint.address, endpoint.pub_address)
        self.ctx = zmq.Context()
        self.dealer = self._sock(zmq.DEALER, endpoint.address, curve)
        self.xsub = self._sock(zmq.XSUB, endpoint.pub_address, curve)  # may send anything as "subscriptions"
        self.sent = 0

    def _sock(self, kind: int, address: str, curve: curve_keys.ClientCurve | None) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        if curve is not None:
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = (
                curve.server_public,
                curve.public,
                curve.secret,
            )
        sock.connect(address)
        return sock

    def run(self, examples: int = 250, round_: int = 0) -> None:
        @seed(round_)  # reproducible, and each round different
        @settings(FUZZ, max_examples=examples)
        @given(parts=frames, raw=raw_stream, sub=st.binary(max_size=64))
        def throw(parts: list[bytes], raw: bytes, sub: bytes) -> None:
            for sock, msg in ((self.dealer, parts), (self.xsub, [sub])):
                try:
                    sock.send_multipart(msg, zmq.NOBLOCK)
                except zmq.Again:
                    pass
            while self.dealer.poll(0):
                self.dealer.recv_multipart()
            for address in self.addresses:
                try:
                    with raw_connection(address) as s:
                        s.sendall(raw)
                except OSError:
                    pass
            self.sent += 1

        throw()

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def _answers(endpoint: Endpoint) -> wire.Hello:
    client = AgentClient(endpoint)
    try:
        return client.hello(timeout=5)
    finally:
        client.close()


def _steps_between(endpoint: Endpoint, start: float, end: float) -> list[float]:
    client = AgentClient(endpoint)
    try:
        reply, steps = client.snapshot(timeout=10)
    finally:
        client.close()
    assert reply.ok, reply.error
    return [s.wall_ns / 1e6 for s in steps if start <= s.t0 <= end]


@pytest.mark.slow  # thousands of frames against a training loop
def test_fuzzed_frames_never_crash_the_agent_nor_slow_training(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """Quiet and fuzzed windows alternate, so the machine's own load drifts out of the ratio."""
    # it trains until ended (600 s at most): the fuzzing's pace is the machine's
    with training_agent(tmp_path, subprocess_env, seconds=600) as (proc, info):
        endpoint = from_discovery(info)
        _answers(endpoint)
        deadline = time.monotonic() + 60  # warm: torch's lazy init done, the hooks found the model
        while len(_steps_between(endpoint, 0, time.time())) < 300 and time.monotonic() < deadline:
            time.sleep(0.2)
        quiet: list[float] = []
        fuzzed: list[float] = []
        fuzzer = Fuzzer(endpoint)
        try:
            for round_ in range(3):
                start = time.time()
                time.sleep(2.0)
                quiet += _steps_between(endpoint, start, time.time())
                start = time.time()
                fuzzer.run(100, round_)
                fuzzed += _steps_between(endpoint, start, time.time())
                assert proc.poll() is None, "the training process died"
        finally:
            fuzzer.close()
        hello = _answers(endpoint)  # the agent still answers
        assert hello.pid == proc.pid
        ratio = median(fuzzed) / median(quiet)
        print(
            f"\nfuzz: {fuzzer.sent} examples; median step {median(quiet):.3f} ms quiet ({len(quiet)} steps), "
            f"{median(fuzzed):.3f} ms fuzzed ({len(fuzzed)} steps): x{ratio:.3f}"
        )
        assert fuzzer.sent == 300 and len(quiet) > 100 and len(fuzzed) > 100
        assert ratio < 1.5, f"the training loop slowed x{ratio:.2f} under fuzzing"


@pytest.mark.slow  # thousands of frames
def test_fuzzed_frames_on_a_curve_agent(curve_setup) -> None:
    """Unauthenticated fuzz reaches nothing; an authorized client's garbage is refused, not fatal."""
    agent = ta.start(bind="0.0.0.0")
    assert agent is not None and agent.sockets.curve is not None
    for curve in (None, _stranger(curve_setup["server_public"]), curve_setup["good"]):
        before = agent.loop.bad_requests
        fuzzer = Fuzzer(Endpoint.tcp("127.0.0.1", agent.port), curve)
        try:
            fuzzer.run(100)
        finally:
            fuzzer.close()
        assert agent.loop.is_alive()
        if curve is not curve_setup["good"]:
            assert agent.loop.bad_requests == before  # nothing they sent was read
    assert agent.loop.bad_requests > 0  # the authorized fuzzer's frames were read, and refused
    assert agent.captures.current is None  # no bad-args request started a capture
    assert _answers(Endpoint.tcp("127.0.0.1", agent.port, curve=curve_setup["good"])).pid == os.getpid()
