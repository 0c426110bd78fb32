"""`torchtop keys`: make the CURVE key pairs for direct remote access, and say how to use them.

    torchtop keys                    this machine's monitor (client) pair; prints its public key
    torchtop keys --server           this machine's agent (server) pair, for TORCHTOP_BIND=0.0.0.0
    torchtop keys --authorize FILE   let the monitor whose client.key is FILE reach agents here

Keys go under the user config directory (agent/contract/curve_keys.py has the layout): directories 0700,
secret files 0600. Existing keys are kept (and printed) unless --force.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from torchtop.contract import curve_keys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", action="store_true", help="the agent's key pair (for a non-loopback bind)")
    p.add_argument("--authorize", metavar="FILE", help="copy a monitor's client.key into authorized_keys/")
    p.add_argument("--name", help="with --authorize: the file name to store it under (default: FILE's name)")
    p.add_argument("--force", action="store_true", help="replace an existing key pair")


def _private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def make_pair(name: str, force: bool = False) -> tuple[Path, Path, bool]:
    """(public file, secret file, created) for `name` ("client" | "server") in the keys dir."""
    directory = _private_dir(curve_keys.keys_dir())
    public, secret = directory / f"{name}.key", directory / f"{name}.key_secret"
    if secret.exists() and public.exists() and not force:
        curve_keys.read_keypair(secret)  # a damaged pair is an error, not silently kept
        return public, secret, False
    import zmq

    pub_key, sec_key = zmq.curve_keypair()
    banner = f"#   torchtop {name} key pair (zmq.auth / ZeroMQ CURVE certificate)\n"
    _write(public, f'{banner}metadata\ncurve\n    public-key = "{pub_key.decode()}"\n', 0o644)
    _write(
        secret,
        f"{banner}#   SECRET: never copy this file off this machine\nmetadata\ncurve\n"
        f'    public-key = "{pub_key.decode()}"\n    secret-key = "{sec_key.decode()}"\n',
        0o600,
    )
    return public, secret, True


def _write(path: Path, text: str, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(tmp, mode)  # the umask may have narrowed it; secret files must be exactly 0600
    os.replace(tmp, path)


def authorize(source: str, name: str | None) -> Path:
    """Check `source` is a public key and copy it into the authorized_keys directory."""
    src = Path(source).expanduser()
    public, _secret = curve_keys.read_cert(src)  # ValueError / OSError when it is not a key file
    if _secret is not None:
        raise ValueError(
            f"{src} holds a secret key: authorize the public half (client.key), never the secret"
        )
    target_dir = _private_dir(curve_keys.authorized_dir())
    stem = (name or src.name).removesuffix(".key")
    dest = target_dir / f"{stem}.key"
    shutil.copyfile(src, dest)
    os.chmod(dest, 0o644)
    return dest


def run(args: argparse.Namespace) -> int:
    try:
        if args.authorize:
            dest = authorize(args.authorize, args.name)
            print(f"authorized {dest}")
            print("restart the agent (it reads authorized_keys/ when it starts) for it to take effect")
            return 0
        name = "server" if args.server else "client"
        public, secret, created = make_pair(name, args.force)
        pub_key = curve_keys.read_cert(public)[0].decode()
    except (OSError, ValueError, curve_keys.KeyConfigError) as exc:
        print(f"torchtop: {exc}", file=sys.stderr)
        return 1
    print(f"{'created' if created else 'existing'} {name} key pair in {public.parent}")
    print(f"public key: {pub_key}")
    print(f"  public file: {public}")
    print(f"  secret file: {secret} (0600; never copy it)")
    auth_dir = curve_keys.authorized_dir()
    if args.server:
        print(
            "\nnext:\n"
            f"  1. let monitors in: copy each monitor's client.key into {auth_dir}/\n"
            "     (or: torchtop keys --authorize their-client.key --name alice)\n"
            '  2. start training with TORCHTOP_BIND=0.0.0.0 (or torchtop.agent.start(bind="0.0.0.0"))\n'
            f"  3. give monitors {public}; they run\n"
            f"     torchtop attach tcp://THIS_HOST:PORT --server-key {public.name}"
        )
    else:
        print(
            "\nnext:\n"
            f"  1. copy {public} to the training machine, into its authorized_keys directory:\n"
            f"     scp {public} HOST:~/.config/torchtop/keys/authorized_keys/$USER.key\n"
            "  2. get the agent's public key file (server.key, made there by `torchtop keys --server`)\n"
            "  3. torchtop attach tcp://HOST:PORT --server-key server.key\n"
            "SSH needs none of this and is the recommended way: torchtop attach ssh://HOST"
        )
    return 0
