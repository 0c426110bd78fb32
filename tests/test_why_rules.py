"""Why, where in the code, what a fix buys: the monitor's side on hand-built data.

Stack samples folded onto steps, the sync / host-code / low-mfu rules at their thresholds,
throughput and MFU against the peak table, each finding's upside, the report's new fields.
"""

from __future__ import annotations

import pytest

from tests.tui_util import T0, steps
from torchtop.contract.logcodes import SAMPLE_PHASES
from torchtop.contract.wire import (
    PROTOCOL_VERSION,
    Batch,
    FlopInfo,
    GpuSample,
    Hello,
    StackSample,
    SyncInfo,
    SyncSite,
    Telemetry,
    Why,
)
from torchtop.monitor.diagnosis.diagnose import diagnose
from torchtop.monitor.diagnosis.facts import THRESHOLDS as T
from torchtop.monitor.diagnosis.facts import Facts, Finding
from torchtop.monitor.diagnosis.peaks import lookup, precision
from torchtop.monitor.diagnosis.report import build_report
from torchtop.monitor.diagnosis.selection import with_upside
from torchtop.monitor.diagnosis.throughput import Throughput, throughput
from torchtop.monitor.diagnosis.why import (
    WhyFacts,
    flag_low_mfu,
    flag_sync,
    refine,
    rule_host_code,
    rule_sync,
)
from torchtop.monitor.model.hotspots import Fold, fold, short_callee, short_site
from torchtop.monitor.model.state import RunState
from torchtop.monitor.model.steps import StepRecord

OTHER = SAMPLE_PHASES.index("other")  # a stack sample's phase index
SITE = "/home/u/train.py:88 log_metrics"
ITEM = "/home/u/train.py:57 main"


def sample(t: float, phase: int, site: str = SITE, callee: str = "", sync: bool = False) -> StackSample:
    return StackSample(int(t * 1e9), phase, site, callee, sync, False)


def spread(recs: list[StepRecord], plan: list[tuple[int, str, str, bool]]) -> list[StackSample]:
    """One sample a step, in the middle of it, cycling through (phase, site, callee, sync)."""
    return [sample(s.t0 + s.wall_ns / 2e9, *plan[k % len(plan)]) for k, s in enumerate(recs)]


def state_with(
    recs: list[StepRecord],
    samples: list[StackSample],
    sync: SyncInfo | None = None,
    flops: FlopInfo | None = None,
    device: str = "cuda",
    device_name: str = "NVIDIA H100 80GB HBM3",
    util: float | None = None,
) -> RunState:
    state = RunState()
    state.apply_hello(
        Hello(v=PROTOCOL_VERSION, run_id="r", pid=1, host="h", port=1, pub_port=2, device=device,
              start_time=T0, device_name=device_name)
    )  # fmt: skip
    end = recs[-1].t0 + recs[-1].wall_ns / 1e9
    tel = Telemetry(time=end, gpus=[GpuSample(index=0, util_gpu=util)]) if util is not None else None
    why = Why(stacks=samples, stack_hz=20.0, sync=sync, flops=flops)
    state.apply_batch(
        Batch(v=PROTOCOL_VERSION, run_id="r", seq=0, time=end, telemetry=tel, why=why), recs, 0.0
    )
    return state


# -- folding -------------------------------------------------------------------------------------
def test_fold_counts_samples_inside_steps_only_by_phase_and_site() -> None:
    recs = steps(n=10, wall_ms=10.0)
    inside = spread(recs, [(OTHER, SITE, "json:dumps", False), (0, ITEM, "", False)])
    outside = [sample(T0 - 1.0, OTHER), sample(recs[-1].t0 + 5.0, OTHER)]  # before / after the steps
    f = fold([(s.t / 1e9, s) for s in outside[:1] + inside + outside[1:]], recs)
    assert f.samples == 10 and f.by_phase == {"other": 5, "data": 5}
    assert f.sites["other"][0].site == SITE and f.sites["other"][0].share == 1.0
    assert f.sites["other"][0].callee == "json:dumps"
    assert short_site(SITE) == "train.py:88 log_metrics"
    assert short_callee("wandb.sdk.wandb_run:Run.log") == "wandb…Run.log"
    assert short_callee("json:dumps") == "json.dumps"


def test_fold_keeps_sync_samples_apart_from_host_sites() -> None:
    recs = steps(n=20)
    f = fold(
        [(s.t / 1e9, s) for s in spread(recs, [(OTHER, ITEM, "", True), (OTHER, SITE, "", False)])], recs
    )
    assert f.sync == 10 and f.sync_by_site == {ITEM: 10} and f.sync_share() == 0.5
    assert [s.site for s in f.host_sites["other"]] == [SITE]


def test_a_gap_between_steps_is_not_a_steps_time() -> None:
    """An evaluation pass between two training steps: its samples count for neither."""
    a, b = steps(n=1, wall_ms=10.0), steps(n=1, wall_ms=10.0, first=100)
    f = fold([(a[0].t0 + 0.5, sample(a[0].t0 + 0.5, OTHER))], a + b)
    assert f.samples == 0


# -- rules -----------------------------------------------------------------------------------------
def facts_with(
    other: float,
    samples: list[tuple[int, str, str, bool]],
    n: int = 40,
    sync: SyncInfo | None = None,
    throughput: Throughput | None = None,
) -> Facts:
    """Facts of a 100 ms step with `other` of it outside the phases, and `n` samples cycling `samples`."""
    recs = steps(n=n, wall_ms=100.0)
    f = Facts(
        steps=n,
        step_ms=100.0,
        shares={"data": 0.0, "h2d": 0.0, "forward": (1 - other) / 2, "backward": (1 - other) / 2, "optimizer": 0.0, "other": other},
        ms={"forward": (1 - other) * 50, "backward": (1 - other) * 50, "other": other * 100},
        device="cuda",
    )  # fmt: skip
    fo = fold([(s.t / 1e9, s) for s in spread(recs, samples)], recs)
    f.why = WhyFacts(fold=fo, sync=sync, stack_hz=20.0, throughput=throughput or Throughput())
    return f


ITEM_SYNC = SyncInfo(
    state="idle", windows=1, sites=[SyncSite(ITEM, ".item()", "", "print(loss.item())", 20, 20)]
)


@pytest.mark.parametrize(
    ("sync_share", "verdict", "flag"),
    [(0.025, None, None), (0.1, None, "info"), (0.25, "warning", None), (0.5, "critical", None)],
)
def test_sync_bands(sync_share: float, verdict: str | None, flag: str | None) -> None:
    k = round(sync_share * 40)
    plan = [(OTHER, ITEM, "", True)] * k + [(2, "/m/model.py:3 f", "", False)] * (40 - k)
    f = facts_with(0.6, plan, sync=ITEM_SYNC)
    v, fl = rule_sync(f), flag_sync(f)
    assert (v.severity if v else None) == verdict
    assert (fl.severity if fl else None) == flag
    found = v or fl
    if found is not None:
        assert found.evidence[0].startswith("`.item()` at train.py:57 main waits ~")
        assert "1.0 calls a step" in found.evidence[0]


H2D = SAMPLE_PHASES.index("h2d")
COPY = "/home/u/train.py:40 main"


def test_a_blocking_copy_to_the_gpu_is_transfer_not_a_sync_stall() -> None:
    """A pageable `.to(device)` waits for the GPU too, inside the h2d phase: the transfer verdict
    judges that time, so the sync rule does not count it again (a transfer-bound loop read sync)."""
    recs = steps(n=20)
    f = fold([(s.t / 1e9, s) for s in spread(recs, [(H2D, COPY, "", True), (OTHER, ITEM, "", True)])], recs)
    assert f.sync == 10 and f.sync_by_site == {ITEM: 10} and f.by_phase["h2d"] == 10
    assert [s.site for s in f.host_sites["h2d"]] == [COPY]


def test_a_wait_on_a_gpu_that_is_busy_all_step_is_a_note_not_a_sync_verdict() -> None:
    """The host waits at `.item()` half the step, but the kernels fill the device step: the GPU is
    the bottleneck and removing the wait buys nothing, so at most an info flag."""
    plan = [(OTHER, ITEM, "", True)] * 20 + [(2, "/m/model.py:3 f", "", False)] * 20
    busy = Throughput(device_busy=0.97, device_busy_ms=97.0, device_step_ms=100.0)
    f = facts_with(0.6, plan, sync=ITEM_SYNC, throughput=busy)
    assert rule_sync(f) is None
    flag = flag_sync(f)
    assert flag is not None and flag.severity == "info"
    idle = Throughput(device_busy=0.4, device_busy_ms=40.0, device_step_ms=100.0)
    v = rule_sync(facts_with(0.6, plan, sync=ITEM_SYNC, throughput=idle))
    assert v is not None and v.severity == "critical"


def test_host_overhead_is_not_the_verdict_when_the_time_is_outside_the_phases() -> None:
    """NVML low and the host busy, but in user code between the phases, not launching kernels."""
    from torchtop.monitor.diagnosis.verdicts import rule_host_overhead

    f = facts_with(0.6, [(OTHER, SITE, "", False)])
    f.gpu_util = 10.0
    assert rule_host_overhead(f) is None
    f = facts_with(0.05, [(2, "/m/model.py:3 f", "", False)])
    f.gpu_util = 10.0
    got = rule_host_overhead(f)
    assert got is not None and got.kind == "host-overhead"


def test_sync_needs_enough_samples() -> None:
    f = facts_with(0.6, [(OTHER, ITEM, "", True)], n=int(T.min_stack_samples) - 1, sync=ITEM_SYNC)
    assert rule_sync(f) is None and flag_sync(f) is None


def test_host_code_names_the_site_and_leaves_the_sync_wait_out() -> None:
    plan = [(OTHER, SITE, "json:dumps", False)] * 3 + [(OTHER, ITEM, "", True)]
    f = facts_with(0.8, plan)
    v = rule_host_code(f)
    assert v is not None and v.kind == "host-code" and v.severity == "critical"
    assert v.share == pytest.approx(0.6)  # 80% outside the phases, a quarter of it waiting on the GPU
    assert "80% of the step (80.0 of 100.0 ms)" in v.evidence[0]
    assert v.evidence[1].startswith("100% in train.py:88 log_metrics → json.dumps")
    assert "train.py:88 log_metrics" in v.advice[0]


def test_host_code_below_the_threshold_or_without_samples_there() -> None:
    assert rule_host_code(facts_with(0.15, [(OTHER, SITE, "", False)])) is None
    assert rule_host_code(facts_with(0.8, [(2, SITE, "", False)])) is None  # no sample in other


def test_a_verdict_that_time_outside_the_phases_dominates_becomes_host_code_where_samples_say_where() -> None:
    outside = Finding(
        "outside-phases", "critical", 0.8, ("80% of step time is outside", "no data wait was measured")
    )
    f = facts_with(0.8, [(OTHER, SITE, "json:dumps", False)])
    got = refine(outside, f)
    assert got.kind == "host-code" and got.severity == "critical"
    assert (
        any("train.py:88 log_metrics" in e for e in got.evidence)
        and "no data wait was measured" in got.evidence
    )
    f = facts_with(0.8, [(2, SITE, "", False)])  # no sample in `other` yet: it stays as it was
    assert refine(outside, f) is outside


def test_low_mfu_flag_needs_busy_nvml_and_a_low_mfu() -> None:
    t = Throughput(
        mfu=0.03, gpu_util=97.0, achieved_tflops=29.7, peak_tflops=989.4, peak_from="H100 SXM bf16"
    )
    f = facts_with(0.1, [(2, SITE, "", False)], throughput=t)
    flag = flag_low_mfu(f)
    assert flag is not None and flag.severity == "warning" and "busy 97%" in flag.evidence[0]
    t.gpu_util = 60.0
    assert flag_low_mfu(f) is None
    t.gpu_util, t.mfu = 97.0, 0.2
    assert flag_low_mfu(f) is None


def test_refine_adds_mfu_to_compute_and_hot_code_to_host_overhead() -> None:
    t = Throughput(mfu=0.41, achieved_tflops=405.0, peak_tflops=989.4, peak_from="H100 SXM bf16")
    f = facts_with(
        0.05, [(2, "/m/model.py:30 Block.forward", "torch.nn.functional:linear", False)], throughput=t
    )
    compute = refine(Finding("compute", "ok", 0.9, ("x",)), f)
    assert compute.evidence[-1].startswith("MFU 41%: 405.0 of 989 TFLOP/s")
    host = refine(Finding("host-overhead", "warning", 0.6, ("x",)), f)
    assert any(
        "host time in forward: 100% in model.py:30 Block.forward → torch…linear" in e for e in host.evidence
    )


# -- throughput, MFU ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "prec", "label", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", "H100 SXM", 989.4),
        ("NVIDIA H100 PCIe", "bf16", "H100 PCIe", 756.5),
        ("NVIDIA H100 NVL", "tf32", "H100 NVL", 417.5),
        ("NVIDIA A100-SXM4-80GB", "bf16", "A100", 312.0),
        ("NVIDIA A10G", "bf16", "A10G", 70.0),
        ("NVIDIA L40S", "fp8", "L40S", 733.0),
        ("NVIDIA L4", "fp16", "L4", 121.0),
        ("Tesla T4", "fp16", "T4", 65.0),
        ("NVIDIA GH200 480GB", "bf16", "GH200", 989.4),
    ],
)
def test_peak_table(name: str, prec: str, label: str, peak: float) -> None:
    assert lookup(name, prec) == (label, peak)


def test_peak_table_says_nothing_it_does_not_know() -> None:
    assert lookup("Tesla T4", "bf16") is None and lookup("Some New GPU", "bf16") is None
    assert precision("float32", tf32=True) == "tf32" and precision("bfloat16", tf32=True) == "bf16"


def test_mfu_from_the_counted_flops_and_the_table() -> None:
    recs = steps(n=20, wall_ms=50.0)
    flops = FlopInfo(state="done", source="counted", flops=int(20e12), by_dtype={"bfloat16": int(19e12), "float32": int(1e12)}, samples=64, tokens=64 * 2048)  # fmt: skip
    t = throughput(recs, flops, "NVIDIA H100 80GB HBM3", gpu_util=99.0)
    assert t.steps_per_s == pytest.approx(20.0)
    assert t.achieved_tflops == pytest.approx(400.0) and t.precision == "bf16"
    assert t.mfu == pytest.approx(400.0 / 989.4) and "H100 SXM" in t.peak_from
    assert t.samples_per_s == pytest.approx(1280.0) and t.tokens_per_s == pytest.approx(1280.0 * 2048)
    flops.peak_tflops = 500.0  # the run's own peak wins over the table
    assert throughput(recs, flops, "NVIDIA H100 80GB HBM3").mfu == pytest.approx(0.8)


def test_marks_override_the_batch_shape_and_device_busy_comes_from_events() -> None:
    recs = steps(n=10, wall_ms=100.0)
    for s in recs:
        s.marks = {"samples": 32.0, "tokens": 4096.0}
        s.device_ms = {"forward": 30.0, "backward": 40.0, "optimizer": 5.0, "step": 100.0}
    t = throughput(recs, FlopInfo(state="done", flops=1, samples=64), "")
    assert t.samples_per_s == pytest.approx(320.0) and t.samples_from == "mark"
    assert t.tokens_per_s == pytest.approx(40960.0)
    assert t.device_busy == pytest.approx(0.75) and t.device_busy_ms == pytest.approx(75.0)
    assert t.mfu is None  # a FLOP count but no device to look up


# -- upside ----------------------------------------------------------------------------------------
def test_upside_of_each_kind_says_bound_or_estimate() -> None:
    f = Facts(
        steps=50,
        step_ms=80.0,
        shares={"data": 0.5},
        ms={"data": 40.0, "h2d": 8.0, "other": 10.0},
        device="cuda",
    )
    data = with_upside(Finding("data-loading", "critical", 0.5), f).upside
    assert data is not None and data.kind == "bound" and data.speedup == pytest.approx(2.0)
    assert "removing the data wait: up to 2.0× steps/s (80.0 → 40.0 ms a step; bound)" == data.text
    transfer = with_upside(Finding("transfer", "warning", 0.1), f).upside
    assert transfer is not None and "overlap up to 8.0 ms of the 80.0 ms step" in transfer.text
    f.gpu_util = 25.0  # NVML only: an estimate
    host = with_upside(Finding("host-overhead", "critical", 0.75), f).upside
    assert host is not None and host.kind == "estimate" and host.new_step_ms == pytest.approx(20.0)
    f.why = WhyFacts(throughput=Throughput(device_busy_ms=16.0, device_step_ms=80.0))
    host = with_upside(Finding("host-overhead", "critical", 0.75), f).upside
    assert host is not None and host.kind == "bound" and "busy 20% of the step (CUDA events)" in host.text
    # a launch-bound loop: kernels trickle in as launched, the events' span runs as long as the
    # host's step; NVML's 25% busy is the smaller, and it is what the GPU's own work can be
    f.why = WhyFacts(throughput=Throughput(device_busy_ms=78.0, device_step_ms=80.0))
    host = with_upside(Finding("host-overhead", "critical", 0.75), f).upside
    assert host is not None and host.kind == "estimate" and host.new_step_ms == pytest.approx(20.0), host
    assert with_upside(Finding("memory-pressure", "warning", 0.95), f).upside is None  # no device total
    outside = with_upside(Finding("outside-phases", "warning", 0.125), f).upside
    assert outside is not None and outside.kind == "bound" and outside.new_step_ms == pytest.approx(70.0)


def test_upside_of_sync_host_code_and_mfu() -> None:
    t = Throughput(mfu=0.05, achieved_tflops=49.5, peak_tflops=989.4, flops_per_step=int(4.95e12), device_busy_ms=30.0, device_step_ms=100.0)  # fmt: skip
    f = facts_with(0.8, [(OTHER, SITE, "", False), (OTHER, ITEM, "", True)], throughput=t, sync=ITEM_SYNC)
    sync = with_upside(Finding("sync", "critical", 0.5), f).upside
    assert sync is not None and sync.kind == "estimate" and sync.new_step_ms == pytest.approx(50.0)
    host = with_upside(Finding("host-code", "warning", 0.4), f).upside
    assert host is not None and host.kind == "estimate" and host.new_step_ms == pytest.approx(60.0)
    compute = with_upside(Finding("compute", "ok", 0.2), f).upside
    assert (
        compute is not None
        and compute.kind == "bound"
        and compute.new_step_ms == pytest.approx(5.0, rel=1e-3)
    )
    low = with_upside(Finding("low-mfu", "warning", 0.05), f).upside
    assert low is not None and low.new_step_ms == pytest.approx(12.5, rel=1e-3)


# -- end to end over a RunState --------------------------------------------------------------------
def test_diagnose_and_report_on_a_state_with_samples() -> None:
    recs = steps(n=60, data=0.0, wall_ms=40.0)
    for s in recs:  # 75% of the step outside the phases
        s.phases = {
            "data": 0,
            "h2d": 0,
            "forward": 5_000_000,
            "backward": 4_000_000,
            "optimizer": 1_000_000,
            "other": 30_000_000,
        }
    samples = spread(recs, [(OTHER, SITE, "json:dumps", False)] * 3 + [(2, "/m/model.py:3 f", "", False)])
    flops = FlopInfo(state="done", source="counted", flops=int(4e11), by_dtype={"bfloat16": int(4e11)}, samples=32, t0=0, t1=0)  # fmt: skip
    state = state_with(recs, samples, sync=SyncInfo(state="idle", windows=2), flops=flops, util=40.0)
    d = diagnose(state)
    assert d.verdict.kind == "host-code" and d.verdict.upside is not None
    r = build_report(state, 10.0)
    assert r["verdict"]["kind"] == "host-code" and r["verdict"]["upside"]["kind"] == "estimate"
    assert r["hot_frames"]["other"][0]["site"] == SITE and r["hot_frames"]["other"][0]["share"] == 1.0
    # the samples in the judged steps (past the first 10, warm-up): the verdict's, folded once
    assert r["stack_samples"]["in_steps"] == 50 and r["stack_samples"]["hz"] == 20.0
    assert r["sync"]["state"] == "idle" and r["sync"]["share"] == 0.0
    th = r["throughput"]
    assert th["flops_per_step"] == int(4e11) and th["achieved_tflops"] == pytest.approx(10.0)
    assert th["mfu"] == pytest.approx(10.0 / 989.4, rel=1e-3) and th["samples_per_s"] == pytest.approx(800.0)


def test_the_flop_counted_step_and_the_next_are_left_out() -> None:
    recs = steps(n=30, wall_ms=10.0)
    counted = recs[15]
    t0 = counted.t0 + 0.0001  # entered just after the boundary's stamp ...
    t1 = counted.t0 + counted.wall_ns / 1e9 + 0.0002  # ... left just after the next one
    flops = FlopInfo(state="done", flops=10, t0=int(t0 * 1e9), t1=int(t1 * 1e9))
    state = state_with(recs[:20], [], flops=flops)
    state.apply_batch(Batch(v=PROTOCOL_VERSION, run_id="r", seq=1, time=recs[-1].t0 + 0.01), recs[20:], 0.0)
    assert [s.i for s in state.steps] == list(range(30))  # the run's steps, every one
    assert [s.i for s in state.window(60.0)] == [*range(15), *range(17, 30)]  # its figures, without the two


def test_catch_up_samples_are_not_counted_twice() -> None:
    recs = steps(n=10)
    ss = spread(recs, [(OTHER, SITE, "", False)])
    state = state_with(recs, ss)
    state.apply_batch(Batch(v=PROTOCOL_VERSION, run_id="r", seq=1, time=1e9, why=Why(stacks=ss)), [], 0.0)
    assert len(state.why.samples) == 10


def test_fold_is_empty_without_samples() -> None:
    assert fold([], steps(n=3)) == Fold()
