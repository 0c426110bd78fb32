"""A node's relay: one process that reads every rank of one job on its node and publishes their
summaries, so that a monitor of a job of many nodes holds one connection per node, not per rank.

It subscribes to each rank's batch stream over the agents' private ipc sockets (the discovery
files of its job, listed again every few seconds), keeps each rank's 1-second buckets
(summary.py) and publishes on its own XPUB, twice a second, one NodeSummary under topic `S`.
A rank's full stream goes out under topic `R<rank>.` only while someone subscribes to it (a
monitor drilling into that rank: XPUB hears the subscription). Requests on its ROUTER are
answered (`hello`) or, with `args["rank"]`, forwarded to that rank's agent and its reply sent
back: captures and snapshots asked of the job reach every rank through the relays. All in one
thread of its own process: the training processes pay nothing per step for it. It listens on
ipc only (the user's 0700 runtime directory); a monitor elsewhere comes through an ssh tunnel.
It exits once its job has had no rank on the node for IDLE_EXIT_S.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from torchtop.contract import discovery, wire
from torchtop.contract.discovery import AgentInfo
from torchtop.contract.private import fits_socket, short_private_tempdir
from torchtop.contract.relay import RelayInfo
from torchtop.monitor.relay import registry
from torchtop.monitor.relay.requests import REQUEST_BUDGET, Desk
from torchtop.monitor.relay.summary import RankSummarizer

SUMMARY_EVERY_S = 0.5
RESCAN_S = 2.0
SILENT_AFTER_S = 3.0  # no batch this long: hello again; unanswered for as long: gone
IDLE_EXIT_S = 20.0
SUMMARY_TOPIC = b"S"
# frames read from one rank's socket a turn (~0.1 s; an agent sends ~1): a rank that floods its
# relay waits its turn, and the others, the requests and the summaries go on
READ_BUDGET = 32
RANK_HWM = 1000  # frames a rank's socket holds unread: a flood is dropped there, not held
MAX_RANKS = 1024  # agents one relay reads (a node's ranks); more entries are left out


def rank_topic(rank: int) -> bytes:
    return b"R%d." % rank


@dataclass
class _Rank:
    pid: int
    info: AgentInfo
    sub: Any
    dealer: Any
    summarizer: RankSummarizer
    hello_asked: float | None = None
    added: float = field(default_factory=time.monotonic)


class Relay:
    def __init__(
        self,
        job_id: str,
        node: str = "",
        directory: Path | None = None,
        source: Callable[[], list[AgentInfo]] = discovery.list_agents,
    ) -> None:
        self.job_id = job_id
        self.source = source  # the node's agents' discovery entries (a benchmark passes its own)
        self.node = node or os.environ.get("TORCHTOP_NODE") or socket.gethostname()
        self.ctx = zmq.Context()
        self.ranks: dict[int, _Rank] = {}
        self.following: set[int] = set()
        self.seq = 0
        self.received = 0
        self.bad_frames = 0
        self._ids = itertools.count(1)
        self._hellos: dict[int, int] = {}  # request id -> pid
        tag = registry.job_tag(job_id)
        directory = directory or _socket_dir(tag)
        self.files = [directory / f"r-{tag}.req", directory / f"r-{tag}.pub"]
        self.address, self.pub_address = (f"ipc://{p}" for p in self.files)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
        self.router.bind(self.address)
        self.desk = Desk(self.router, self.node, self._ids)
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 1000)
        self.pub.setsockopt(zmq.MAXMSGSIZE, 1 << 16)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's `S`: a newcomer gets the hellos
        self.pub.bind(self.pub_address)
        for path in self.files:
            os.chmod(path, 0o600)
        self.started = time.time()
        self.tcp: tuple[str, str, str] | None = None  # (request, stream, server public key) when on TCP
        self._auth: Any = None

    def listen_tcp(self, bind: str, port: int) -> None:
        """Also listen on TCP `port` (requests) and `port + 1` (summaries), CURVE only, with this
        machine's configured server key and authorized client keys (`torchtop keys --server`):
        a monitor elsewhere then reaches the relay without ssh. KeyConfigError (what to do) without
        them: a relay never listens on TCP in the clear."""
        import zmq.auth
        from zmq.auth.thread import ThreadAuthenticator

        from torchtop.contract import curve_keys
        from torchtop.contract.net import tcp_address

        curve = curve_keys.load_server(bind)  # KeyConfigError: no keys, no TCP
        self._auth = ThreadAuthenticator(self.ctx)
        self._auth.start()
        self._auth.configure_curve(domain="torchtop", location=str(curve.authorized))
        # the same ROUTER and XPUB also listen on TCP: options are taken when an endpoint is
        # bound, so the ipc ends stay as they were and the TCP ends are CURVE servers
        for sock, p in ((self.router, port), (self.pub, port + 1)):
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret)
            sock.setsockopt(zmq.ZAP_DOMAIN, b"torchtop")
            sock.setsockopt(zmq.IPV6, int(":" in bind))
            sock.bind(tcp_address(bind, p))
        host = socket.gethostname() if bind in ("0.0.0.0", "::", "*") else bind
        self.tcp = (tcp_address(host, port), tcp_address(host, port + 1), curve.public.decode())

    def entry(self) -> RelayInfo:
        """The relay's discovery entry (and what goes into the job's store: no secrets)."""
        tcp, tcp_pub, key = self.tcp if self.tcp is not None else (None, None, None)
        return RelayInfo(
            pid=os.getpid(),
            job_id=self.job_id,
            node=self.node,
            address=self.address,
            pub_address=self.pub_address,
            host=socket.gethostname(),
            ssh_host=os.environ.get("TORCHTOP_NODE") or socket.gethostname(),  # how a monitor reaches it
            start_time=self.started,
            version=_version(),
            tcp_address=tcp,
            tcp_pub_address=tcp_pub,
            server_key=key,
        )

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
        for r in self.ranks.values():
            r.sub.close(linger=0)
            r.dealer.close(linger=0)
        self.router.close(linger=0)
        self.pub.close(linger=0)
        self.ctx.term()
        for path in self.files:
            try:
                path.unlink()
            except OSError:
                pass

    # -- the node's ranks ----------------------------------------------------------------------
    def rescan(self, now: float) -> None:
        seen = set()
        for info in self.source():
            pid = info.pid
            if info.job_id != self.job_id or pid is None:
                continue
            seen.add(pid)
            if pid not in self.ranks and len(self.ranks) < MAX_RANKS:
                self._add(pid, info, now)
        for pid, r in list(self.ranks.items()):
            if pid not in seen:  # its process ended (its discovery file is gone)
                r.summarizer.gone = True
                if r.summarizer.last_batch is None or now - r.summarizer.last_batch > 60:
                    r.sub.close(linger=0)
                    r.dealer.close(linger=0)
                    del self.ranks[pid]

    def _add(self, pid: int, info: AgentInfo, now: float) -> None:
        address, pub = info.address, info.pub_address
        if info.unusable is not None or address is None or pub is None or not address.startswith("ipc://"):
            return  # a rank on TCP only (CURVE): the monitor reaches it per rank, as before
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME_BYTES)
        sub.setsockopt(zmq.RCVHWM, RANK_HWM)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub)
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME_BYTES)
        dealer.connect(address)
        r = _Rank(pid, info, sub, dealer, RankSummarizer(info.rank if info.rank is not None else -1))
        self.ranks[pid] = r
        self._ask_hello(r, now)

    def _ask_hello(self, r: _Rank, now: float) -> None:
        req_id = next(self._ids)
        self._hellos[req_id] = r.pid
        r.hello_asked = now
        try:
            r.dealer.send(
                wire.encode(wire.Request(v=wire.PROTOCOL_VERSION, id=req_id, cmd="hello")), zmq.NOBLOCK
            )
        except zmq.Again:
            pass

    # -- one turn ------------------------------------------------------------------------------
    def _decoded(self, sock: zmq.Socket) -> Iterator[tuple[bytes, wire.Message]]:
        """The frames waiting on `sock`, READ_BUDGET at most, decoded (those that fail are
        counted and skipped)."""
        for _ in range(READ_BUDGET):
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = wire.decode(frame)
            except wire.WireError:
                self.bad_frames += 1
                continue
            yield frame, msg

    def _read_rank(self, r: _Rank, now: float) -> None:
        topic = rank_topic(r.summarizer.rank) if r.summarizer.rank in self.following else None
        for frame, msg in self._decoded(r.sub):
            if not isinstance(msg, wire.Batch):
                self.bad_frames += 1
                continue
            self.received += 1
            r.summarizer.add_batch(msg, now)
            if topic is not None:
                try:
                    self.pub.send_multipart([topic, frame], zmq.NOBLOCK)
                except zmq.Again:
                    pass

    def _read_replies(self, r: _Rank, now: float) -> None:
        for _frame, msg in self._decoded(r.dealer):
            if not isinstance(msg, wire.Reply):
                continue
            if msg.id in self._hellos:
                del self._hellos[msg.id]
                r.hello_asked = None
                if msg.ok and msg.hello is not None:
                    if msg.hello.job_id != self.job_id:  # never mix jobs: the pid was reused
                        r.summarizer.gone = True
                        continue
                    r.summarizer.set_hello(msg.hello)
            else:
                self.desk.route_back(msg)

    def _rank_of(self, rank: object) -> _Rank | None:
        """The agent of `rank` on this node: of two that claim it, the live one heard last."""
        mine = [r for r in self.ranks.values() if r.summarizer.rank == rank]
        return max(mine, key=lambda r: (not r.summarizer.gone, r.summarizer.last_batch or 0.0), default=None)

    def _hello_data(self) -> dict[str, Any]:
        return {"relay": self.entry().to_json(), "ranks": self._rank_list()}

    def duplicates(self) -> list[str]:
        """Ranks that two of the node's agents claim: "rank 1: pids 41, 97"."""
        by: dict[int, list[int]] = {}
        for r in self.ranks.values():
            if r.summarizer.hello is not None:
                by.setdefault(r.summarizer.rank, []).append(r.pid)
        return [
            f"rank {k}: pids {', '.join(map(str, sorted(v)))}" for k, v in sorted(by.items()) if len(v) > 1
        ]

    def _rank_list(self) -> list[dict[str, Any]]:
        return [{"rank": r.summarizer.rank, "pid": r.pid} for r in self.ranks.values()]

    def _subscriptions(self) -> None:
        for _ in range(REQUEST_BUDGET):  # a subscriber flooding (un)subscriptions waits its turn
            try:
                msg = self.pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if msg == b"\x01" + SUMMARY_TOPIC:  # a monitor joined: every rank's hello in the next summary
                for r in self.ranks.values():
                    r.summarizer.resend_hello()
                continue
            if len(msg) > 2 and msg[1:2] == b"R" and msg.endswith(b"."):
                try:
                    rank = int(msg[2:-1])
                except ValueError:
                    continue
                on = msg[0] == 1
                if on != (rank in self.following):  # XPUB_VERBOSE repeats joins: act on a change only
                    (self.following.add if on else self.following.discard)(rank)
                    self._watch(rank, on)

    def _watch(self, rank: int, on: bool) -> None:
        """A monitor drills into `rank` through the relay: the rank is watched (its why probes run)
        while it does; the relay alone leaves them resting (wire.WATCH_TOPIC)."""
        for r in self.ranks.values():
            if r.summarizer.rank == rank:
                r.sub.setsockopt(zmq.SUBSCRIBE if on else zmq.UNSUBSCRIBE, wire.WATCH_TOPIC)

    def summary(self, now: float) -> wire.NodeSummary:
        for r in self.ranks.values():
            s = r.summarizer
            silent = s.last_batch is None or now - s.last_batch > SILENT_AFTER_S
            if silent and r.hello_asked is None and now - r.added > SILENT_AFTER_S:
                self._ask_hello(r, now)
            elif silent and r.hello_asked is not None and now - r.hello_asked > SILENT_AFTER_S:
                s.gone = True
        self.desk.expire(now)
        self.seq += 1
        return wire.NodeSummary(
            v=wire.PROTOCOL_VERSION,
            job_id=self.job_id,
            node=self.node,
            seq=self.seq,
            time=time.time(),
            relay_pid=os.getpid(),
            ranks=[r.summarizer.summary(now) for r in self.ranks.values()],
            received=self.received,
            bad_frames=self.bad_frames,
            summary_v=wire.SUMMARY_VERSION,
            duplicates=self.duplicates()[:16],
        )

    def run(self, stop: threading.Event | None = None, idle_exit_s: float = IDLE_EXIT_S) -> None:
        rescan_at = next_summary = time.monotonic()
        last_rank = time.monotonic()
        while stop is None or not stop.is_set():
            now = time.monotonic()
            if now >= rescan_at:
                self.rescan(now)
                rescan_at = now + RESCAN_S
                if any(not r.summarizer.gone for r in self.ranks.values()):
                    last_rank = now
                elif now - last_rank > idle_exit_s:
                    return
            if now >= next_summary:
                frame = wire.encode(self.summary(now))
                try:
                    self.pub.send_multipart([SUMMARY_TOPIC, frame], zmq.NOBLOCK)
                except zmq.Again:
                    pass
                next_summary = max(next_summary + SUMMARY_EVERY_S, now)
            # every rank's stream read at most every 0.1 s: each read takes what came meanwhile
            time.sleep(0.1)
            self.desk.answer(now, self._hello_data, self._rank_of)
            self._subscriptions()
            now = time.monotonic()
            for r in list(self.ranks.values()):
                self._read_rank(r, now)
                self._read_replies(r, now)


def _socket_dir(tag: str) -> Path:
    directory = discovery.runtime_dir()
    if fits_socket(directory, len(f"r-{tag}.req")):
        os.close(discovery.open_runtime_dir())  # made private (0700) when missing
        return directory
    return short_private_tempdir("torchtop-relay-")


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("torchtop")
    except Exception:  # broad: no package metadata (a source tree): version unknown
        return ""
