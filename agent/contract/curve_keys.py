"""CURVE key files: where they live and how they are read, for the agent and the monitor alike.

Layout (zmq.auth certificate format, so `zmq.auth.load_certificate` reads the same files):

    $TORCHTOP_CONFIG_DIR, else $XDG_CONFIG_HOME/torchtop, else ~/.config/torchtop   (0700)
      keys/                         0700
        client.key                  the monitor's public key: copy it to the agent's machine
        client.key_secret           the monitor's secret key, 0600, never leaves this machine
        server.key                  the agent's public key: give it to monitors (--server-key)
        server.key_secret           the agent's secret key, 0600
        authorized_keys/            client public keys (*.key) the agent accepts, one file each

The agent reads its secret key from $TORCHTOP_SERVER_KEY (else keys/server.key_secret) and the
client keys it allows from $TORCHTOP_AUTHORIZED_KEYS (else keys/authorized_keys/). Reading needs
neither zmq nor torch (monitor's pure modules use it); writing keys needs zmq (curve_keypair).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

ENV_CONFIG = "TORCHTOP_CONFIG_DIR"
ENV_SERVER_KEY = "TORCHTOP_SERVER_KEY"
ENV_AUTHORIZED = "TORCHTOP_AUTHORIZED_KEYS"
ENV_CURVE = "TORCHTOP_CURVE"  # "1": on a loopback bind, these keys rather than a pair for this run
Z85_KEY_LEN = 40


class KeyConfigError(Exception):
    """A key file that is missing or unreadable; the message says what to run."""


def config_dir() -> Path:
    explicit = os.environ.get(ENV_CONFIG)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CONFIG_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".config"
    return base / "torchtop"


def keys_dir() -> Path:
    return config_dir() / "keys"


def server_secret_path() -> Path:
    explicit = os.environ.get(ENV_SERVER_KEY)
    return Path(explicit).expanduser() if explicit else keys_dir() / "server.key_secret"


def authorized_dir() -> Path:
    explicit = os.environ.get(ENV_AUTHORIZED)
    return Path(explicit).expanduser() if explicit else keys_dir() / "authorized_keys"


def read_cert(path: Path) -> tuple[bytes, bytes | None]:
    """(public, secret or None) from a zmq.auth certificate file; ValueError when it holds none."""
    public = secret = None
    for raw in path.read_bytes().splitlines():
        line = raw.strip()
        if line.startswith(b"#") or b"=" not in line:
            continue
        name, value = (part.strip() for part in line.split(b"=", 1))
        value = value.strip(b" \t'\"")
        if name == b"public-key":
            public = value
        elif name == b"secret-key":
            secret = value
    if public is None or len(public) != Z85_KEY_LEN or (secret is not None and len(secret) != Z85_KEY_LEN):
        raise ValueError(f"{path} is not a CURVE certificate (no 40-character public-key line)")
    return public, secret


def read_keypair(path: Path) -> tuple[bytes, bytes]:
    """A public + secret pair from `path` (or from `path`_secret when `path` is the public half)."""
    candidates = [path] if str(path).endswith("_secret") else [Path(f"{path}_secret"), path]
    for candidate in candidates:
        if candidate.is_file():
            public, secret = read_cert(candidate)
            if secret is not None:
                return public, secret
    raise FileNotFoundError(f"no secret key in {path}")


def read_public(spec: str) -> bytes:
    """A server public key given as a file path or as the 40-character key itself."""
    if len(spec) == Z85_KEY_LEN and not os.path.exists(spec):
        return spec.encode("ascii")
    try:
        return read_cert(Path(spec).expanduser())[0]
    except OSError as exc:
        raise KeyConfigError(f"cannot read the server key {spec} ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise KeyConfigError(str(exc)) from None


@dataclass(frozen=True)
class ServerCurve:
    """What an agent needs to be a CURVE server: its keypair and the clients it allows."""

    public: bytes
    secret: bytes
    authorized: Path


@dataclass(frozen=True)
class ClientCurve:
    """What a monitor needs to reach a CURVE agent: the agent's public key and its own pair."""

    server_public: bytes
    public: bytes
    secret: bytes


def curve_wanted(loopback: bool) -> bool:
    """Whether an agent on TCP uses these configured keys: always off loopback; on loopback when
    asked (env). Otherwise a loopback agent makes a key pair for its run (CURVE either way)."""
    return (
        not loopback or bool(os.environ.get(ENV_SERVER_KEY)) or os.environ.get(ENV_CURVE, "") not in ("", "0")
    )


def load_server(bind: str) -> ServerCurve:
    """The agent's CURVE configuration; KeyConfigError saying exactly what to do when incomplete."""
    secret_path = server_secret_path()
    auth_dir = authorized_dir()
    fix = (
        f"to listen on {bind}, run `torchtop keys --server` on this machine, copy each monitor's "
        f"client.key (made by `torchtop keys` there) into {auth_dir}/, and restart; or keep the "
        "default (private local sockets) and attach over SSH (torchtop attach ssh://HOST)"
    )
    try:
        public, secret = read_keypair(secret_path)
    except (OSError, ValueError) as exc:
        raise KeyConfigError(f"no CURVE server key ({exc}): {fix}") from None
    try:
        allowed = [p for p in auth_dir.iterdir() if p.name.endswith(".key") and p.is_file()]
    except OSError:
        allowed = []
    if not allowed:
        raise KeyConfigError(f"no authorized client keys (*.key) in {auth_dir}: {fix}")
    return ServerCurve(public, secret, auth_dir)


KNOWN_SERVERS = "known_servers"  # keys/known_servers/*.key: servers' public keys this user trusts


def known_server_keys() -> set[str]:
    """The server public keys (Z85) the user's own keys directory holds: its server.key (the
    same on every node that shares the home directory) and each *.key in keys/known_servers/
    (a node's server.key, copied). A key only a job's store names is not among them."""
    d = keys_dir()
    paths = [d / "server.key"]
    try:
        paths += sorted(p for p in (d / KNOWN_SERVERS).iterdir() if p.name.endswith(".key"))[:4096]
    except OSError:
        pass
    out: set[str] = set()
    for path in paths:
        try:
            if path.is_file() and path.stat().st_size <= 4096:
                out.add(read_cert(path)[0].decode("ascii"))
        except (OSError, ValueError):
            continue
    return out


def load_client(server_key: str) -> ClientCurve:
    """The monitor's CURVE configuration for an agent whose public key is `server_key`."""
    server_public = read_public(server_key)
    path = keys_dir() / "client.key_secret"
    try:
        public, secret = read_keypair(path)
    except (OSError, ValueError):
        raise KeyConfigError(
            f"no client key at {path}: run `torchtop keys`, then copy {keys_dir() / 'client.key'} into "
            "the agent machine's authorized_keys directory"
        ) from None
    return ClientCurve(server_public, public, secret)
