"""Issue 35 item 7: MFU is never above 100%. A FLOP count counted over one step stands only for
steps of its shape (variable shapes: unknown), a figure above the peak is refused and said why,
and where the GPU's counters (GPM) disagree with the count the counters' figure is shown, with why."""

from __future__ import annotations

from torchtop.contract.wire import FlopInfo
from torchtop.monitor.diagnosis.facts import Facts, Finding
from torchtop.monitor.diagnosis.gpm import GpmFigures, flag_mfu_disagree
from torchtop.monitor.diagnosis.throughput import FROM_COUNTERS, FROM_FLOPS, mfu_line, throughput
from torchtop.monitor.diagnosis.upside import compute_upside
from torchtop.monitor.diagnosis.why import WhyFacts, refine
from torchtop.monitor.model.steps import StepRecord

PEAK = 100.0  # TFLOP/s (the run's own peak: no device table needed)


def _steps(n: int = 40, step_ms: float = 10.0, tokens: list[int] | None = None) -> list[StepRecord]:
    ns = int(step_ms * 1e6)
    out = []
    for i in range(n):
        t = tokens[i % len(tokens)] if tokens else 4096
        out.append(
            StepRecord(i, 1000.0 + i * step_ms / 1e3, ns, {"forward": ns}, samples=8, tokens=t, seq=t // 8)
        )
    return out


def _flops(mfu: float, step_ms: float = 10.0) -> FlopInfo:
    """A count that gives `mfu` of PEAK at `step_ms` a step."""
    return FlopInfo(
        state="done",
        source="counted",
        flops=int(mfu * PEAK * 1e12 * step_ms / 1e3),
        by_dtype={"float32": 1},
        peak_tflops=PEAK,
    )


def _facts(t_steps: list[StepRecord], flops: FlopInfo, counters: GpmFigures | None = None) -> Facts:
    f = Facts(steps=len(t_steps), step_ms=10.0, shares={"forward": 1.0}, ms={"forward": 10.0}, device="cuda")
    f.gpm = counters
    f.why = WhyFacts(throughput=throughput(t_steps, flops, "NVIDIA H100 80GB HBM3", 95.0, counters))
    return f


def test_a_count_above_the_peak_is_refused_and_says_why() -> None:
    t = throughput(_steps(), _flops(1.3), "", None)
    assert t.mfu is None and t.flop_mfu is not None and t.flop_mfu > 1.0
    assert "the FLOP count does not match these steps: it gives 130% of the 100 TFLOP/s peak" in t.mfu_note
    line = mfu_line(t)
    assert line is not None and line.startswith("MFU unknown: the FLOP count does not match"), line
    # a verdict's MFU line says so too, and no upside is built on it
    f = _facts(_steps(), _flops(1.3))
    got = refine(Finding("compute", "ok", 1.0, ("forward+backward+optimizer are 100% of step time",)), f)
    assert any(e.startswith("MFU unknown:") for e in got.evidence), got.evidence
    assert compute_upside(f) is None
    # at the peak or under it: the count's figure, said to be the count's
    ok = throughput(_steps(), _flops(0.4), "", None)
    assert ok.mfu is not None and abs(ok.mfu - 0.4) < 0.01 and ok.mfu_from == FROM_FLOPS


def test_variable_shapes_make_one_count_stand_for_none() -> None:
    varying = _steps(tokens=[2048, 4096, 8192, 3072])
    t = throughput(varying, _flops(0.4), "", None)
    assert t.mfu is None and t.achieved_tflops is None, t
    assert "the batch shapes vary (tokens 2,048-8,192 a step)" in t.mfu_note, t.mfu_note
    # an epoch's last, shorter batch is one step among many: the count still stands
    last_short = _steps(tokens=[4096] * 19 + [1024])
    t = throughput(last_short, _flops(0.4), "", None)
    assert t.mfu is not None and t.mfu_from == FROM_FLOPS


def test_the_counters_figure_is_shown_where_they_disagree_with_the_count() -> None:
    # the job: a variable-shape fp32 run, 130% from the count, tensor cores idle
    idle = GpmFigures(sm_active=40.0, tensor_active=0.0, counter_mfu=0.0)
    t = throughput(_steps(), _flops(1.3), "", 90.0, idle)
    assert t.mfu == 0.0 and t.mfu_from == FROM_COUNTERS, t
    assert "tensor cores active 0%" in t.mfu_note and "does not match these steps" in t.mfu_note, t.mfu_note
    # the count says 40%, the counters 12%: the counters', and why
    low = GpmFigures(sm_active=60.0, tensor_active=14.0, counter_mfu=0.12)
    t = throughput(_steps(), _flops(0.4), "", 90.0, low)
    assert t.mfu == 0.12 and t.mfu_from == FROM_COUNTERS and "the FLOP count gives 40%" in t.mfu_note
    line = mfu_line(t)
    assert line is not None and line.startswith("MFU 12% from the GPU's counters"), line
    # the disagreement flag still compares the count's own figure with the counters'
    flag = flag_mfu_disagree(_facts(_steps(), _flops(0.4), low))
    assert flag is not None and "MFU from the FLOP count 40%, from the GPU's counters 12%" in flag.evidence[0]
    # within 10 points: the count's figure stands
    near = GpmFigures(sm_active=60.0, tensor_active=40.0, counter_mfu=0.35)
    t = throughput(_steps(), _flops(0.4), "", 90.0, near)
    assert t.mfu_from == FROM_FLOPS and t.mfu is not None and abs(t.mfu - 0.4) < 0.01


def test_mfu_is_never_above_one() -> None:
    for mfu in (0.1, 0.99, 1.0, 1.01, 1.3, 5.0):
        for counters in (None, GpmFigures(50.0, 30.0, 0.3)):
            for tokens in (None, [1000, 5000]):
                t = throughput(_steps(tokens=tokens), _flops(mfu), "", 90.0, counters)
                assert t.mfu is None or 0.0 <= t.mfu <= 1.0, (mfu, counters, tokens, t)
