"""Issue 38 item 5, alerts without watching: a change of verdict, a stall's start and end and a
flag raised are events (monitor/diagnosis/events.py), counted once a change by the exporter
(`torchtop_events_total`), with the stall's gauge (`torchtop_stalled_seconds`); docs/alerts.yml
loads in Prometheus's rule checker and fires on the exporter's own output for a hung job."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.rank_util import hello
from torchtop.contract.logcodes import COMM
from torchtop.contract.why import StackSample
from torchtop.monitor.commands.export import agent_samples
from torchtop.monitor.diagnosis.events import EventLog, changes, stalled_s
from torchtop.monitor.diagnosis.facts import Diagnosis, Finding
from torchtop.monitor.export.figures import METRICS, Sample
from torchtop.monitor.export.job_figures import job_samples
from torchtop.monitor.model.job_state import JobState
from torchtop.monitor.model.state import RunState
from torchtop.monitor.model.steps import StepRecord

ROOT = Path(__file__).resolve().parents[1]
ALERTS = ROOT / "docs" / "alerts.yml"
STEP_S = 0.1
SCRAPE_S = 15
SLEEP = "/job/train.py:42 wait_here"
TRAIN = "/job/train.py:57 main"
needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="no promtool (apt install prometheus)"
)


def _run(state: RunState, seconds: float) -> None:
    """Steps of STEP_S for `seconds` after the agent's clock."""
    t0 = state.agent_time
    i0 = len(state.steps)
    for k in range(int(seconds / STEP_S)):
        state.steps.append(StepRecord(i=i0 + k, t0=t0 + k * STEP_S, wall_ns=int(STEP_S * 1e9), phases={}))
    state.agent_time = t0 + seconds


def _hang(state: RunState, seconds: float, phase: int, site: str, callee: str) -> None:
    """No step end for `seconds` more, the stack sampler at 10 Hz where the thread is."""
    end = state.agent_time
    for k in range(1, int(seconds * 10) + 1):
        t = end + k / 10
        state.why.samples.append((t, StackSample(int(t * 1e9), phase, site, callee)))
    state.agent_time = end + seconds


def _fresh(rank: int, world: int) -> RunState:
    st = RunState()
    st.apply_hello(hello(rank, world, job_id="j"))
    st.agent_time = 1000.0
    return st


def _render(got: list[Sample]) -> str:
    """The exporter's /metrics text for these samples: its collector through prometheus_client."""
    from prometheus_client import CollectorRegistry, generate_latest  # pyright: ignore[reportMissingImports]  # optional

    from torchtop.monitor.export.figures import SampleBoard
    from torchtop.monitor.export.prometheus import TorchtopCollector

    board = SampleBoard()
    board.publish(got)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(TorchtopCollector(board))
    return generate_latest(registry).decode()


def _hung_job_scrapes(running: int, hung: int) -> list[str]:
    """The exporter's text every SCRAPE_S: a single process (its agent's series) and a 3-rank job
    (job mode: the job's series) running for `running` scrapes, then hung for `hung` more: rank 1
    of the job sleeps outside any collective, the others wait in all_reduce."""
    single = _fresh(0, 1)
    ranks = JobState("j")
    for r in range(3):
        ranks.member(f"rank{r}").state.apply_hello(hello(r, 3, job_id="j"))
        ranks.member(f"rank{r}").state.agent_time = 1000.0
    verdicts: dict[str, Any] = {}
    events: dict[str, EventLog] = {}
    out = []
    for k in range(running + hung):
        states = [single, *(m.state for m in ranks.live())]
        for r, st in enumerate(states):
            if k < running:
                _run(st, SCRAPE_S)
            elif r == 2:  # the job's rank 1
                _hang(st, SCRAPE_S, 0, SLEEP, "time.sleep")
            else:
                _hang(st, SCRAPE_S, COMM, TRAIN, "torch.distributed:all_reduce")
        got = agent_samples(
            single, single.hello, "a", "hung-process", True, len(single.steps), 10.0, 10.0, verdicts, events
        )
        mode = job_samples(ranks, 10.0, "hung-job", single.agent_time, verdicts=verdicts, events=events)
        out.append(_render(got) + _render(mode))  # two exporters: an agent's, a job's (`--store`)
    return out


def _input_series(scrapes: list[str]) -> list[dict[str, str]]:
    """promtool's input_series from the scraped texts: each series' value at each scrape ('_':
    absent from that scrape)."""
    from prometheus_client.parser import text_string_to_metric_families  # pyright: ignore[reportMissingImports]  # optional

    values: dict[str, list[str]] = {}
    for k, text in enumerate(scrapes):
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.endswith("_created"):
                    continue
                labels = ",".join(f'{n}="{v}"' for n, v in sorted(s.labels.items()))
                values.setdefault(f"{s.name}{{{labels}}}", ["_"] * len(scrapes))[k] = repr(float(s.value))
    return [{"series": name, "values": " ".join(v)} for name, v in sorted(values.items())]


def _promtool_test(tmp_path: Path, series: list[dict[str, str]], eval_s: int, expected: list[dict]) -> str:
    spec = {
        "rule_files": [str(ALERTS)],
        "evaluation_interval": f"{SCRAPE_S}s",
        "tests": [
            {
                "interval": f"{SCRAPE_S}s",
                "input_series": series,
                "alert_rule_test": [
                    {"eval_time": f"{eval_s}s", "alertname": "TorchtopJobStalled", "exp_alerts": expected}
                ],
            }
        ],
    }
    path = tmp_path / "stalled_test.yml"
    path.write_text(json.dumps(spec, indent=1))  # JSON is YAML: no YAML library needed
    done = subprocess.run(
        ["promtool", "test", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    return f"rc={done.returncode}\n{done.stdout}\n{done.stderr}"


@needs_promtool
def test_the_alert_rules_load_in_prometheus_rule_checker() -> None:
    done = subprocess.run(
        ["promtool", "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for name in ("TorchtopJobStalled", "TorchtopStraggler", "TorchtopCheckpointBound", "TorchtopOOMSoon", "TorchtopNotReporting"):  # fmt: skip
        assert f"alert: {name}" in ALERTS.read_text()


@needs_promtool
@pytest.mark.export
def test_the_stalled_alert_fires_on_the_exporters_output_for_a_hung_job(tmp_path: Path) -> None:
    scrapes = _hung_job_scrapes(running=3, hung=5)
    assert "torchtop_stalled_seconds" in scrapes[-1] and "torchtop_events_total" in scrapes[-1]
    series = _input_series(scrapes)
    stalled = [s for s in series if s["series"].startswith("torchtop_stalled_seconds")]
    assert len(stalled) == 2  # the single process's (its rank's) and the job's
    assert all(s["values"].split()[:3] == ["0.0"] * 3 for s in stalled)  # 0 while steps end
    # the last scrape: hung 75 s (the stall counts from the last step's end)
    assert all(float(s["values"].split()[-1]) >= 60 for s in stalled)
    end_s = (len(scrapes) - 1) * SCRAPE_S
    expected = [
        {
            "exp_labels": {"severity": "critical", "job": job},
            "exp_annotations": _annotations("TorchtopJobStalled", job),
        }
        for job in ("hung-job", "hung-process")
    ]
    out = _promtool_test(tmp_path, series, end_s, expected)
    assert out.startswith("rc=0"), out
    # while the steps still ended (the third scrape), nothing fires
    early = _promtool_test(tmp_path, series, 2 * SCRAPE_S, [])
    assert early.startswith("rc=0"), early


def _annotations(alert: str, job: str) -> dict[str, str]:
    """The rule's annotations as Prometheus fills them for `job` (they name only its labels)."""
    text = ALERTS.read_text()
    block = text[text.index(f"- alert: {alert}\n") :].split("- alert: ")[1]
    found = re.findall(r'^\s+(summary|description): (".*")$', block, re.M)
    return {k: json.loads(v).replace("{{ $labels.job }}", job) for k, v in found}


def _d(kind: str, severity: str = "warning", flags: tuple[Finding, ...] = ()) -> Diagnosis:
    return Diagnosis(Finding(kind, severity, 0.5, (f"{kind} line",)), flags)  # type: ignore[arg-type]


def test_events_are_the_changes_of_the_verdict_in_force() -> None:
    log = EventLog()
    assert log.observe(_d("compute", "ok"), 1.0) == []  # where the log starts: no change
    assert log.observe(_d("compute", "ok"), 2.0) == []
    got = log.observe(_d("stalled", "critical"), 3.0)
    assert [(e.kind, e.severity, e.line, e.role) for e in got] == [
        ("stalled", "critical", "stalled line", "verdict")
    ]
    assert log.observe(_d("unknown", "ok"), 4.0) == []  # too few steps to judge: no news
    got = log.observe(_d("checkpoint", "warning"), 5.0)
    assert [(e.kind, e.role) for e in got] == [("resumed", "resumed"), ("checkpoint", "verdict")]
    leak = Finding("memory-leak", "warning", 0.0, ("grows 12 MiB a step",))
    got = log.observe(_d("checkpoint", "warning", (leak,)), 6.0)
    assert [(e.kind, e.role, e.line) for e in got] == [("memory-leak", "flag", "grows 12 MiB a step")]
    assert log.observe(_d("checkpoint", "warning", (leak,)), 7.0) == []
    assert changes(_d("compute", "ok"), _d("compute", "warning"), 8.0)[0].severity == "warning"
    assert [e.time for e in log.events] == [3.0, 5.0, 5.0, 6.0]


def test_the_events_counter_counts_a_change_once_not_once_a_refresh() -> None:
    st = _fresh(0, 1)
    verdicts: dict[str, Any] = {}
    events: dict[str, EventLog] = {}

    def counted() -> dict[tuple[str, str], float]:
        got = agent_samples(st, st.hello, "a", "j", True, len(st.steps), 10.0, 10.0, verdicts, events)
        assert {s.name for s in got} <= set(METRICS)
        return {
            (dict(s.labels)["kind"], dict(s.labels)["severity"]): s.value
            for s in got
            if s.name == "torchtop_events"
        }

    for _ in range(4):
        _run(st, 15)
        assert ("stalled", "critical") not in counted()
    for _ in range(5):  # one stall seen over five refreshes: one event
        _hang(st, 15, 0, SLEEP, "time.sleep")
        assert counted()[("stalled", "critical")] == 1
    assert stalled_s([st]) == pytest.approx(75)
    _run(st, 15)
    after = counted()
    assert after[("stalled", "critical")] == 1 and after[("resumed", "info")] == 1
    assert stalled_s([st]) == 0.0
    _run(st, 15)
    assert counted() == after  # steps go on, the verdict holds: nothing more counted


def test_a_recordings_report_lists_its_windows_events(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Events are not stored: `report FILE` judges the recording again a second at a time (the
    verdict in force: hysteresis) and lists the window's changes; a window after them lists none."""
    from tests.recording_util import BATCH_S, T0, batch
    from tests.recording_util import hello as rec_hello
    from torchtop.contract import recording_store as store
    from torchtop.monitor.commands.cli import main

    w = store.RecordingWriter(tmp_path, 0, store.DEFAULT_MAX_BYTES)
    w.write(rec_hello())
    for k in range(400):  # 20 s of compute, then 20 s waiting on data
        w.write(batch(k, data_share=0.0 if k < 200 else 0.6))
    w.close()

    def events(*extra: str) -> list[dict[str, Any]]:
        assert main(["report", str(tmp_path), *extra]) == 0
        return json.loads(capsys.readouterr().out)["events"]

    got = events("--seconds", "40")
    verdicts = [e for e in got if e["role"] == "verdict"]
    assert [e["kind"] for e in verdicts][-1] == "data-loading", got
    # once a change, not once a second: into data-loading, then its severity as the window fills
    loading = [e["severity"] for e in verdicts if e["kind"] == "data-loading"]
    assert loading in (["warning", "critical"], ["critical"]), got
    change = next(e for e in verdicts if e["kind"] == "data-loading")
    assert T0 + 200 * BATCH_S <= change["time"] <= T0 + 400 * BATCH_S and change["line"]
    assert [e["time"] for e in got] == sorted(e["time"] for e in got)
    assert events("--seconds", "5") == []  # the last 5 s: data-bound all along, no change
