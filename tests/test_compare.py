"""`torchtop compare`: the differences between runs and their direction, from recordings."""

from __future__ import annotations

import io
import json
import re
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from tests.recording_util import write
from torchtop.monitor.commands.cli import main
from torchtop.monitor.commands.compare import cpu_has_bf16
from torchtop.monitor.diagnosis.report_types import MemoryDevice, ReportError, decode_report
from torchtop.monitor.model.compare import change, compare, render_text


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def rows(result: dict) -> dict[str, dict]:
    return {r["key"]: r for r in result["rows"]}


def test_change_direction() -> None:
    assert change(10.0, 5.0, "lower") == {"delta": -5.0, "ratio": 0.5, "relative": -0.5, "verdict": "better"}
    assert change(10.0, 5.0, "higher")["verdict"] == "worse"  # type: ignore[index]
    assert change(10.0, 10.1, "lower")["verdict"] == "same"  # type: ignore[index]
    assert change(None, 1.0, "lower") is None


def test_compare_recordings_says_which_is_faster(tmp_path: Path) -> None:
    """A: 100 steps/s, 60% of each step waiting on data; B: 200 steps/s, no data wait."""
    write(tmp_path / "slow", 200, steps_per_chunk=10, data_share=0.6)
    write(tmp_path / "fast", 200, steps_per_chunk=20)
    code, out, _ = run_cli(
        "compare", str(tmp_path / "slow"), str(tmp_path / "fast"), "--json", "--names", "slow,fast"
    )
    assert code == 0
    result = json.loads(out)
    r = rows(result)
    assert r["steps_per_s"]["values"][0] == pytest.approx(100, rel=0.05)
    assert r["steps_per_s"]["values"][1] == pytest.approx(200, rel=0.05)
    assert r["steps_per_s"]["changes"][0]["verdict"] == "better"
    assert r["step_time.median"]["changes"][0]["ratio"] == pytest.approx(0.5, rel=0.05)
    assert r["phase.data"]["changes"][0]["verdict"] == "better"  # 6 ms of data wait -> none
    # the synthetic steps are 30% forward and nothing else timed: 70% outside the measured phases
    assert [run["verdict"] for run in result["runs"]] == ["data-loading", "outside-phases"]
    text = render_text(result)
    assert re.search(r"steps/s\s+100\b.*\+100\.\d% \(2\.00x faster\) ✓", text), text
    assert "data-loading (critical)" in text


def test_compare_needs_two_recordings(tmp_path: Path) -> None:
    write(tmp_path / "a", 20)
    code, _, err = run_cli("compare", str(tmp_path / "a"))
    assert code == 2 and "two recordings" in err
    code, _, err = run_cli("compare", str(tmp_path / "a"), str(tmp_path / "missing"))
    assert code == 2 and "no such file" in err


def _device(peak: int) -> dict[str, int | None]:
    return dict.fromkeys(MemoryDevice.__struct_fields__, 0) | {
        "peak_allocated": peak,
        "fragmentation": None,
    }


def test_memory_peak_is_cuda_peak_or_rss() -> None:
    # as an older torchtop wrote them: what a report lacks decodes to its default
    cpu = decode_report({"host": {"available": True, "proc_rss": 100, "proc_rss_peak": 300}, "memory": {}})
    cuda = decode_report(
        {"host": {"available": True, "proc_rss": 100}, "memory": {"devices": [_device(5), _device(7)]}}
    )
    assert cuda.memory.devices and cuda.memory.devices[1].peak_allocated == 7 and cpu.steps == 0
    result = compare([cpu, cuda], ["cpu", "cuda"])
    assert rows(result)["memory_peak"]["values"] == [300.0, 7.0]
    assert [r["memory_kind"] for r in result["runs"]] == ["peak RSS", "CUDA peak allocated"]


def test_a_malformed_report_is_one_line() -> None:
    for bad in (b"{not json", b'{"steps": "many"}', b"[1, 2]"):
        with pytest.raises(ReportError) as err:
            decode_report(bad, "old.json")
        assert str(err.value).startswith("old.json is not a torchtop report: ") and "\n" not in str(err.value)


@pytest.mark.slow
def test_amp_and_fp32_demos_compare_with_the_right_signs(tmp_path: Path) -> None:
    """The mixed-precision demo in FP32 and in bf16 autocast on the CPU, recorded and compared:
    the speed and memory differences have the signs the demos measure themselves (their own
    clock and its peak RSS); on a CPU without bf16 instructions (AVX2 only) the comparison says
    bf16 is emulated, and on one with them it does not. Which is faster is the machine's (CI's
    bf16-capable CPU once ran bf16 at 6.2 steps/s against fp32's 8.6 under the suite's load), so
    only the signs are asserted."""
    code, out, err = run_cli(
        "compare",
        "--demo",
        "amp",
        "--device",
        "cpu",
        "--demo-seconds",
        "12",
        "--json",
        "--out",
        str(tmp_path),
    )
    assert code == 0, err
    own = {
        name: (float(rate), float(rss))
        for name, rate, rss in re.findall(
            r"(\w+): stopped after .*\(([\d.]+) steps/s\); peak RSS ([\d.]+) MiB", err
        )
    }
    assert set(own) == {"fp32", "bf16"}, err
    r = rows(json.loads(out))
    speed = r["steps_per_s"]["changes"][0]
    memory = r["memory_peak"]["changes"][0]
    assert (speed["delta"] > 0) == (own["bf16"][0] > own["fp32"][0])
    assert (memory["delta"] > 0) == (own["bf16"][1] > own["fp32"][1])
    notes = json.loads(out)["notes"]
    emulated = any("no bf16 instructions" in n for n in notes)
    assert emulated == (cpu_has_bf16() is False), notes


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_amp_and_fp32_demos_compare_on_cuda(tmp_path: Path, dtype: str) -> None:
    """On a GPU: the speed and CUDA allocator peak differences have the signs the demos measure
    themselves (their clock, torch.cuda.max_memory_allocated)."""
    code, out, err = run_cli(
        "compare",
        "--demo",
        "amp",
        "--device",
        "cuda",
        "--amp-dtype",
        dtype,
        "--demo-seconds",
        "20",
        "--json",
        "--out",
        str(tmp_path),
    )
    assert code == 0, err
    own = {
        name: (float(rate), float(peak))
        for name, rate, peak in re.findall(
            r"(\w+): stopped after .*\(([\d.]+) steps/s\).*CUDA peak allocated ([\d.]+) MiB", err
        )
    }
    assert set(own) == {"fp32", dtype}, err
    result = json.loads(out)
    assert [r["memory_kind"] for r in result["runs"]] == ["CUDA peak allocated"] * 2
    r = rows(result)
    speed, memory = r["steps_per_s"]["changes"][0], r["memory_peak"]["changes"][0]
    assert (speed["delta"] > 0) == (own[dtype][0] > own["fp32"][0])
    assert (memory["delta"] > 0) == (own[dtype][1] > own["fp32"][1])
    # the host CPU's bf16 is not the GPU's: no such note on CUDA
    assert not any("no bf16 instructions" in n for n in json.loads(out)["notes"]), err
    print(f"\n{dtype} vs fp32 on CUDA: speed x{speed['ratio']:.2f}, memory peak x{memory['ratio']:.2f}")


def test_thin_runs_and_a_cpu_without_bf16_are_said(tmp_path: Path) -> None:
    """2 steps against 129: the ratio is printed with a note that the data is thin."""
    fast = {"steps": 129, "steps_per_s": 6.5, "step_time_ms": {"median": 150.0}}
    slow = {"steps": 2, "steps_per_s": 0.47, "step_time_ms": {"median": 2100.0}}
    emulated = "this CPU has no bf16 instructions"
    result = compare([decode_report(fast), decode_report(slow)], ["fp32", "bf16"], [emulated])
    assert [r["thin"] for r in result["runs"]] == [False, True]
    assert result["notes"][0].startswith("B: bf16 has 2 steps to compare (129 in the run with the most)")
    assert result["notes"][1] == emulated
    text = render_text(result)
    assert "slower) ✗ (thin: see note)" in text and "note: B: bf16 has 2 steps" in text
    assert f"note: {emulated}" in text
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor : 0\nflags : fpu sse avx2 fma\n")
    assert cpu_has_bf16(str(cpuinfo)) is False
    cpuinfo.write_text("processor : 0\nflags : fpu avx2 avx512f avx512_bf16\n")
    assert cpu_has_bf16(str(cpuinfo)) is True
    assert cpu_has_bf16(str(tmp_path / "none")) is None


def test_figures_that_read_as_zero_are_not_compared_as_ratios() -> None:
    """Issue 39: "achieved TFLOP/s 0.0 -> 0.0 -88.4% (8.59x slower)". A small rate keeps two
    digits, so its change reads true; a figure shown as zero on both sides gets no change."""
    a = {
        "steps": 200,
        "steps_per_s": 50.0,
        "throughput": {"achieved_tflops": 0.0042},
        "phase_ms": {"h2d": 0.0001},
    }
    b = {
        "steps": 200,
        "steps_per_s": 50.0,
        "throughput": {"achieved_tflops": 0.000489},
        "phase_ms": {"h2d": 0.0003},
    }
    result = compare([decode_report(a), decode_report(b)], ["A", "B"])
    tflops, h2d = rows(result)["tflops"], rows(result)["phase.h2d"]
    assert tflops["changes"][0]["verdict"] == "worse" and h2d["changes"] == [None]
    text = render_text(result)
    assert re.search(r"achieved TFLOP/s\s+0\.0042\s+0\.00049\s+-88\.4% \(8\.59x slower\) ✗", text), text
    assert re.search(r"  h2d\s+0\.000 ms\s+0\.000 ms$", text, re.M), text


def test_the_thin_note_names_demo_seconds_only_for_demo_runs() -> None:
    fast = decode_report({"steps": 129, "steps_per_s": 6.5})
    slow = decode_report({"steps": 1, "steps_per_s": 0.47})
    (user,) = compare([fast, slow], ["a.rec", "b.rec"])["notes"]
    assert user.startswith("B: b.rec has 1 step to compare") and "--demo-seconds" not in user, user
    assert "record the run longer" in user
    (demo,) = compare([fast, slow], ["fp32", "bf16"], demo=True)["notes"]
    assert "(--demo-seconds)" in demo
