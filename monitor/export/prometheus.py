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
    from prometheus_client.registry import CollectorRegistry


class TorchtopCollector:
    """prometheus_client's collector protocol over a SampleBoard."""

    def __init__(self, board: SampleBoard) -> None:
        self.board = board

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

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


def serve(board: SampleBoard, port: int, addr: str = "127.0.0.1") -> tuple[Any, CollectorRegistry]:
    """Serve /metrics on addr:port in a daemon thread; (the server, its registry)."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(TorchtopCollector(board))
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    return server, registry
