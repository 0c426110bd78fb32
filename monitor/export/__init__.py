"""Figures for the tools a fleet already runs: Prometheus and OpenTelemetry metrics, Perfetto traces.

figures.py and perfetto.py are pure (no textual, zmq or torch); prometheus.py and otlp.py load
their client libraries (the `export` extra) only when used.
"""
