"""OpenTelemetry: the exporter's samples as OTLP metrics over HTTP (opentelemetry-sdk).

Observable instruments read the latest samples when the SDK's periodic reader collects (every
`interval_s`), and the OTLP/HTTP exporter pushes them to a collector (e.g.
http://localhost:4318/v1/metrics). Counters are cumulative; the rest are gauges. The SDK and the
exporter are the `export` extra.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torchtop.monitor.export.figures import METRICS, SampleBoard


def start(board: SampleBoard, endpoint: str, interval_s: float = 5.0) -> Any:
    """A MeterProvider exporting every metric in METRICS from `board`; call `.shutdown()` to
    flush and stop it."""
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter  # pyright: ignore[reportMissingImports]  # optional
    from opentelemetry.sdk.metrics import MeterProvider  # pyright: ignore[reportMissingImports]  # optional
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader  # pyright: ignore[reportMissingImports]  # optional
    from opentelemetry.sdk.resources import Resource  # pyright: ignore[reportMissingImports]  # optional

    reader = PeriodicExportingMetricReader(
        OTLPMetricExporter(endpoint=endpoint), export_interval_millis=int(interval_s * 1000)
    )
    provider = MeterProvider(metric_readers=[reader], resource=Resource.create({"service.name": "torchtop"}))
    meter = provider.get_meter("torchtop")
    for name, (kind, doc, _) in METRICS.items():
        make = meter.create_observable_counter if kind == "counter" else meter.create_observable_gauge
        make(name, callbacks=[_callback(board, name)], description=doc)
    return provider


def _callback(board: SampleBoard, name: str) -> Any:
    from opentelemetry.metrics import Observation  # pyright: ignore[reportMissingImports]  # optional

    def observe(_options: Any) -> Iterator[Observation]:
        for s in board.read():
            if s.name == name:
                yield Observation(s.value, dict(s.labels))

    return observe
