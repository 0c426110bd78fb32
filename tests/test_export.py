"""`torchtop export`: a 2-rank job's figures, scraped by Prometheus and pushed over OTLP.

Two real agents (two training processes with RANK 0 and 1, WORLD_SIZE 2, as torchrun sets
them) and a real `torchtop export` process that finds them. Prometheus: the real server scrapes
the exporter where the binary exists, and the client library's own parser reads /metrics over a
real HTTP GET in any case. OTLP: a local HTTP sink decodes what the exporter pushes.
"""

from __future__ import annotations

import http.server
import json
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from torchtop.contract.wire import LogChunk
from torchtop.monitor.diagnosis.report_types import decode_report
from torchtop.monitor.export.figures import METRICS, samples
from torchtop.monitor.model.budget import StepBudget

CHILD = """
import os, sys, time, torch
torch.set_num_threads(1)
import torchtop.agent as ta
ta.start()
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(512, 32)), batch_size=16)
end = time.time() + float(sys.argv[1])
while time.time() < end:
    for (x,) in data:
        loss = model(x).square().mean()
        opt.zero_grad(); loss.backward(); opt.step()
        time.sleep(0.002)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Sink(http.server.BaseHTTPRequestHandler):
    bodies: list[bytes] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        n = int(self.headers.get("Content-Length", 0))
        Sink.bodies.append(self.rfile.read(n))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    pytest.importorskip("prometheus_client")
    pytest.importorskip("opentelemetry.sdk.metrics")
    import os

    tmp = tmp_path_factory.mktemp("job")
    env = dict(os.environ, PYTHONUNBUFFERED="1", TORCHTOP_RUNTIME_DIR=str(tmp / "rt"), TORCHTOP_QUIET="1")
    env["TORCHTOP_PHASE_EVERY"] = "1"
    script = tmp / "train.py"
    script.write_text(CHILD)
    # the ranks and the exporter run until killed below: lengths of their own could run out before a
    # loaded machine's three tests of the module
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), "600"],
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2"),
        )
        for r in (0, 1)
    ]
    sink = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    port = free_port()
    exporter = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torchtop.monitor.commands.cli",
            "export",
            "--prometheus",
            f"127.0.0.1:{port}",
            "--otlp",
            f"http://127.0.0.1:{sink.server_address[1]}/v1/metrics",
            "--otlp-interval",
            "1",
            "--job",
            "demo-job",
            "--seconds",
            "590",
        ],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield {"port": port, "tmp": tmp, "exporter": exporter}
    finally:
        for p in (exporter, *ranks):
            p.kill()
            p.wait(10)
        sink.shutdown()


def wait_for_ranks(port: int, timeout: float = 60.0) -> dict:
    """The parsed /metrics once both ranks have steps, a rate and a verdict."""
    from prometheus_client.parser import text_string_to_metric_families  # pyright: ignore[reportMissingImports]  # optional

    deadline = time.monotonic() + timeout
    families: dict = {}
    while time.monotonic() < deadline:
        try:
            text = get(f"http://127.0.0.1:{port}/metrics")
        except OSError:
            time.sleep(0.5)
            continue
        families = {f.name: f for f in text_string_to_metric_families(text)}
        ranks = {s.labels["rank"] for s in getattr(families.get("torchtop_steps"), "samples", [])}
        verdicts = {s.labels["rank"] for s in getattr(families.get("torchtop_verdict"), "samples", [])}
        rates = getattr(families.get("torchtop_steps_per_second"), "samples", [])
        rated = {s.labels["rank"] for s in rates if s.value > 0}  # a loaded machine's ranks start late
        if ranks == verdicts == rated == {"0", "1"}:
            return families
        time.sleep(0.5)
    raise AssertionError(f"no metrics of both ranks within {timeout} s: {sorted(families)}")


@pytest.mark.slow
@pytest.mark.export
def test_metrics_of_a_two_rank_job_read_by_prometheus_clients_parser(job: dict) -> None:
    families = wait_for_ranks(job["port"])
    steps = {
        s.labels["rank"]: s for s in families["torchtop_steps"].samples if s.name == "torchtop_steps_total"
    }
    assert set(steps) == {"0", "1"} and all(s.value > 0 for s in steps.values())
    assert {s.labels["job"] for s in steps.values()} == {"demo-job"}
    assert {s.labels["node"] for s in steps.values()} == {socket.gethostname()}
    phases = {(s.labels["rank"], s.labels["phase"]) for s in families["torchtop_phase_seconds"].samples}
    assert ("0", "forward") in phases and ("1", "backward") in phases
    rates = {s.labels["rank"]: s.value for s in families["torchtop_steps_per_second"].samples}
    assert set(rates) == {"0", "1"} and all(v > 1 for v in rates.values()), rates
    # labels stay bounded: job, node, rank and the catalogue's names (a phase, a verdict or flag and
    # its severity, an event's kind and severity)
    for family in families.values():
        for s in family.samples:
            assert set(s.labels) - {"job", "node", "rank"} <= {
                "phase",
                "verdict",
                "flag",
                "severity",
                "kind",
            }, s


@pytest.mark.slow
@pytest.mark.export
@pytest.mark.skipif(shutil.which("prometheus") is None, reason="no Prometheus server binary")
def test_a_real_prometheus_server_scrapes_the_exporter(job: dict) -> None:
    wait_for_ranks(job["port"])
    tmp: Path = job["tmp"]
    cfg = tmp / "prometheus.yml"
    cfg.write_text(
        "global: {scrape_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: torchtop\n    static_configs: [{{targets: ['127.0.0.1:{job['port']}']}}]\n"
    )
    web = free_port()
    server = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={cfg}",
            f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{web}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        query = urllib.parse.urlencode({"query": "torchtop_steps_total"})
        deadline = time.monotonic() + 60
        result: list = []
        while time.monotonic() < deadline:
            try:
                body = json.loads(get(f"http://127.0.0.1:{web}/api/v1/query?{query}"))
                result = body["data"]["result"]
            except (OSError, KeyError, ValueError):
                result = []
            if {r["metric"].get("rank") for r in result} == {"0", "1"}:
                break
            time.sleep(1)
        assert {r["metric"]["rank"] for r in result} == {"0", "1"}, result
        assert all(float(r["value"][1]) > 0 for r in result)
        # the exporter's own job label is kept beside the scrape's (honor_labels is off: exported_job)
        assert {r["metric"].get("exported_job") for r in result} == {"demo-job"}
    finally:
        server.kill()
        server.wait(10)


@pytest.mark.slow
@pytest.mark.export
def test_otlp_metrics_carry_both_ranks(job: dict) -> None:
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest  # pyright: ignore[reportMissingImports]  # optional

    wait_for_ranks(job["port"])
    deadline = time.monotonic() + 30
    seen: dict[str, set[str]] = {}
    wanted = ("torchtop_steps", "torchtop_phase_seconds")  # phases: once a timed step was replayed
    while time.monotonic() < deadline and not all({"0", "1"} <= seen.get(m, set()) for m in wanted):
        for body in list(Sink.bodies):
            req = ExportMetricsServiceRequest.FromString(body)
            for rm in req.resource_metrics:
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        points = m.sum.data_points if m.HasField("sum") else m.gauge.data_points
                        for p in points:
                            attrs = {a.key: a.value.string_value for a in p.attributes}
                            seen.setdefault(m.name, set()).add(attrs.get("rank", "?"))
        time.sleep(0.5)
    assert {"0", "1"} <= seen.get("torchtop_steps", set()), seen
    assert {"0", "1"} <= seen.get("torchtop_phase_seconds", set()), seen


def test_the_replay_budget_bounds_the_work_and_keeps_counts_exact() -> None:
    """10,000 steps/s in chunks of 1,000 for 20 s, a budget of 500 steps/s: about 500 a second
    replayed, the count and the rate exact."""
    budget = StepBudget(500.0)
    budget.filter([LogChunk(0, 1000, [])], now=0.0)
    assert budget.rate_now() is None  # one count says nothing of a rate: the sample is left out, not 0
    kept = 1000
    for k in range(1, 200):
        chunk = LogChunk(k, (k + 1) * 1000, [])
        kept += 1000 * len(budget.filter([chunk], now=k * 0.1))
    assert budget.steps == 200_000
    assert budget.rate_now() == pytest.approx(10_000, rel=0.02)
    assert 500 * 20 * 0.5 <= kept <= 500 * 20 + 1000


def test_samples_name_only_known_metrics_with_bounded_labels() -> None:
    report = {
        "steps": 10,
        "timed_steps": 10,
        "step_time_ms": {"median": 2.0, "p90": 3.0, "mean": 2.5},
        "phase_ms": {"forward": 1.0, "data": 0.5},
        "breakdown": {"forward": 0.4, "data": 0.2},
        "device_ms": {"step": 1.5},
        "memory": {
            "available": True,
            "allocated": 5,
            "reserved": 8,
            "peak_allocated": 9,
            "alloc_retries": 0,
            "ooms": 0,
        },
        "gpu": {"devices": [{"index": 0, "util_gpu": 80.0, "mem_used": 3, "power_w": -1.0, "temp_c": 50.0}]},
        "host": {
            "available": True,
            "proc_cpu": 150.0,
            "proc_rss": 100,
            "workers": [{"pid": 7, "rss": 1, "dataloader": True, "cpu_percent": 90.0}],
        },
        "verdict": {"kind": "data-loading", "severity": "warning", "share": 0.2},
        "flag_details": [{"kind": "memory-leak", "severity": "warning"}],
        "dropped": 0,
        "hook_errors": 0,
    }
    got = samples(decode_report(report), "j", "n", 3, True, 1234, 56.0)
    by = {
        (
            s.name,
            dict(s.labels).get("phase") or dict(s.labels).get("verdict") or dict(s.labels).get("flag"),
        ): s.value
        for s in got
    }
    assert {s.name for s in got} <= set(METRICS)
    assert by[("torchtop_steps", None)] == 1234 and by[("torchtop_phase_seconds", "forward")] == 0.001
    assert (
        by[("torchtop_gpu_utilization_ratio", None)] == 0.8 and ("torchtop_gpu_power_watts", None) not in by
    )
    assert by[("torchtop_verdict", "data-loading")] == 2 and by[("torchtop_flag", "memory-leak")] == 2
    assert by[("torchtop_process_cpu_cores", None)] == 1.5  # cores: more than 1 is no ratio
    assert by[("torchtop_phase_share_ratio", "forward")] == 0.4
    # Prometheus naming: a _ratio is 0..1; a share is a ratio; CPU in cores says so
    assert all(0 <= s.value <= 1 for s in got if s.name.endswith("_ratio"))
    assert all(name.endswith("_ratio") for name in METRICS if "share" in name)
    assert all(dict(s.labels)["rank"] == "3" for s in got)


def test_the_grafana_dashboard_names_only_exported_metrics() -> None:
    import re

    dashboard = json.loads(
        (Path(__file__).resolve().parent.parent / "docs" / "grafana-torchtop.json").read_text()
    )
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    names = {re.sub(r"_total$", "", n) for e in exprs for n in re.findall(r"torchtop_\w+", e)}
    assert names and names <= set(METRICS), names - set(METRICS)
    counters = {n for e in exprs for n in re.findall(r"torchtop_\w+_total", e)}
    assert all(METRICS[n.removesuffix("_total")][0] == "counter" for n in counters)
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"job", "node", "rank"} <= variables
