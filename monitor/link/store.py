"""The job's rendezvous store (torchrun's MASTER_ADDR:MASTER_PORT TCPStore) without torch.

Relays write where they listen under one key of the job (`relays_key`); a monitor reads it to find
every node's relay. The monitor never imports torch, so this is a small client of the store's own
protocol (c10d TCPStore: a VALIDATE frame with its magic number, then query frames of a type
byte and uint64-length-prefixed strings; torch's client puts "/" before every key, and so do we,
so torch.distributed.TCPStore reads and writes the same keys). Only CHECK, GET and APPEND are
used: a key is checked before it is read, as GET on a missing key would wait for it. What goes
in: endpoints and CURVE public keys, never a secret. No telemetry goes through the store or the
job's collectives.
"""

from __future__ import annotations

import socket
import struct
from typing import NamedTuple

from torchtop.contract.relay import RelayInfo, relay_info, relay_line

VALIDATE, GET, CHECK, APPEND = 0, 3, 5, 9
MAGIC = 0x3C85F7CE
READY = 0
KEY_PREFIX = "torchtop/v1"
MAX_VALUE = 4 << 20  # a relays key of 8,192 nodes is ~2 MB


class StoreError(Exception):
    """The store cannot be reached or read; the message names it and says what to do."""


JOBS_KEY = f"{KEY_PREFIX}/jobs"  # the ids of the jobs whose relays registered here


def relays_key(job_id: str) -> str:
    """One key per job: two jobs sharing a store (or nodes) never read each other's relays."""
    return f"{KEY_PREFIX}/{job_id}/relays"


def _string(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


class StoreClient:
    def __init__(self, host: str, port: int, timeout: float = 3.0) -> None:
        self.where = f"{host}:{port}"
        try:
            self.sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise StoreError(
                f"cannot reach the job's rendezvous store at {self.where} ({exc}): run this on a node of "
                "the job, pass --store HOST:PORT (torchrun's --master-addr:--master-port), or name the "
                "nodes (ssh://host ..., --hosts FILE, --slurm)"
            ) from None
        self.sock.settimeout(timeout)
        self._send(struct.pack("<BI", VALIDATE, MAGIC))

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except OSError as exc:
            raise StoreError(f"the store at {self.where} dropped the connection ({exc})") from None

    def _recv(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            try:
                got = self.sock.recv(n - len(out))
            except OSError as exc:
                raise StoreError(f"no answer from the store at {self.where} ({exc})") from None
            if not got:
                raise StoreError(f"the store at {self.where} closed the connection (not a TCPStore?)")
            out += got
        return out

    def check(self, key: str) -> bool:
        self._send(bytes([CHECK]) + struct.pack("<Q", 1) + _string("/" + key))
        return self._recv(1)[0] == READY

    def get(self, key: str) -> bytes | None:
        """The key's value; None when it is not set."""
        if not self.check(key):
            return None
        self._send(bytes([GET]) + _string("/" + key))
        (size,) = struct.unpack("<Q", self._recv(8))
        if size > MAX_VALUE:
            raise StoreError(f"the store at {self.where} sent {size} bytes for {key}: not read")
        return self._recv(size)

    def append(self, key: str, value: bytes) -> None:
        self._send(bytes([APPEND]) + _string("/" + key) + _string(value))


def parse_store(spec: str) -> tuple[str, int]:
    """HOST:PORT (or [v6]:PORT); ValueError saying what is expected."""
    host, sep, port = spec.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"--store takes HOST:PORT (torchrun's master address and port), not {spec!r}")
    return host.strip("[]"), int(port)


def store_of_job(job_id: str) -> tuple[str, int] | None:
    """The rendezvous address a job id carries (agent/identity.py joins it last, after '@')."""
    addr = job_id.rpartition("@")[2]
    try:
        return parse_store(addr)
    except ValueError:
        return None


def publish_relay(host: str, port: int, job_id: str, entry: RelayInfo, timeout: float = 3.0) -> None:
    """Append one relay's entry (one JSON line) to the job's relays key."""
    with StoreClient(host, port, timeout) as store:
        store.append(relays_key(job_id), relay_line(entry))
        store.append(JOBS_KEY, (job_id + "\n").encode())
        store.check(relays_key(job_id))  # a round trip: the append has been read by the store


def read_jobs(host: str, port: int, timeout: float = 3.0) -> list[str]:
    """The job ids whose relays registered in this store, in order."""
    with StoreClient(host, port, timeout) as store:
        raw = store.get(JOBS_KEY)
    return list(dict.fromkeys(j for j in (raw or b"").decode(errors="replace").splitlines() if j))


class Registrations(NamedTuple):
    """What the job's relays key holds: every relay entry of the job, in the order written (a
    node's restarts, and whatever else anyone who reaches the store appended: all kept), and the
    lines that are not one, with why (the first few)."""

    entries: list[RelayInfo]
    skipped: int = 0
    reasons: tuple[str, ...] = ()


MAX_LINES = 16_384  # lines of the relays key read: 16 registrations a node at 1,024 nodes


def read_relays(host: str, port: int, job_id: str, timeout: float = 3.0) -> Registrations:
    """Every relay registration of the job; none when none registered. The store is the job's
    rendezvous, which anyone who reaches its port can write: nothing here is trusted yet
    (relay_targets.py decides what is used)."""
    with StoreClient(host, port, timeout) as store:
        raw = store.get(relays_key(job_id))
    entries: list[RelayInfo] = []
    skipped, reasons = 0, []
    lines = (raw or b"").splitlines()
    for line in lines[:MAX_LINES]:
        if not line.strip():
            continue
        try:
            entry = relay_info(line)
        except ValueError as exc:
            entry, why = None, str(exc)
        else:
            why = "" if entry.job_id == job_id else f"an entry of job {entry.job_id[:60]}"
        if entry is None or why:
            skipped += 1
            if len(reasons) < 3:
                reasons.append(why[:160])
            continue
        entries.append(entry)
    skipped += max(0, len(lines) - MAX_LINES)
    return Registrations(entries, skipped, tuple(reasons))
