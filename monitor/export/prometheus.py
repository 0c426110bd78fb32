"""Prometheus: the exporter's samples served by prometheus_client on /metrics.

A custom collector reads the latest samples at each scrape (the exporter's loop replaces them
about once a second), so a scrape costs the same whatever the step rate. prometheus_client is
the `export` extra: `pip install 'torchtop[export]'`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from torchtop.monitor.export.figures import METRICS, Sample, SampleBoard

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry  # pyright: ignore[reportMissingImports]  # optional


class TorchtopCollector:
    """prometheus_client's collector protocol over a SampleBoard."""

    def __init__(self, board: SampleBoard) -> None:
        self.board = board

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # pyright: ignore[reportMissingImports]  # optional

        by_name: dict[str, list[Sample]] = {}
        for s in self.board.read():
            by_name.setdefault(s.name, []).append(s)
        for name, group in by_name.items():
            kind, doc, _ = METRICS[name]
            labels = [k for k, _ in group[0].labels]
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
                name, doc, labels=labels
            )
            for s in group:
                family.add_metric([v for _, v in s.labels], s.value)
            yield family

    def describe(self) -> list[Any]:
        return []  # the metric set follows the agents: nothing to check at registration


IDLE_TIMEOUT_S = 10.0  # a connection that sends nothing this long is closed (its thread ends)
MAX_CONNECTIONS = 64  # open at once; more are closed at once (each holds a thread)


def serve(board: SampleBoard, port: int, addr: str = "127.0.0.1") -> tuple[Any, CollectorRegistry]:
    """Serve /metrics on addr:port in a daemon thread; (the server, its registry).

    prometheus_client's own server keeps a thread per connection for as long as the peer keeps
    it open without a word; this one times idle connections out and caps how many are open."""
    import socket
    import threading
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    from prometheus_client import CollectorRegistry, make_wsgi_app  # pyright: ignore[reportMissingImports]  # optional

    registry = CollectorRegistry(auto_describe=False)
    registry.register(TorchtopCollector(board))
    slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    class Handler(WSGIRequestHandler):
        timeout = IDLE_TIMEOUT_S  # StreamRequestHandler sets it on the socket: reads time out

        def log_message(self, format: str, *args: Any) -> None:
            pass  # scrapes are not news

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True
        block_on_close = False

        def process_request(self, request: Any, client_address: Any) -> None:
            if not slots.acquire(blocking=False):
                self.shutdown_request(request)  # full: this connection is closed, nothing held
                return
            super().process_request(request, client_address)

        def process_request_thread(self, request: Any, client_address: Any) -> None:
            try:
                super().process_request_thread(request, client_address)
            finally:
                slots.release()

        def handle_error(self, request: Any, client_address: Any) -> None:
            pass  # a peer that timed out or hung up: its connection is closed, nothing to say

    infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    Server.address_family, host = infos[0][0], str(infos[0][4][0])  # an IP family's: (host, port, ...)
    server = make_server(host, port, make_wsgi_app(registry), Server, handler_class=Handler)
    threading.Thread(target=server.serve_forever, daemon=True, name="torchtop-metrics").start()
    return server, registry
