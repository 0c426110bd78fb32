"""The why panel and the verdict's upside line, fed a batch with stack samples, sync sites, FLOPs."""

from __future__ import annotations

import pytest

from tests.test_tui_panels import app_without_feed, fed, hello
from tests.tui_util import steps
from torchtop.contract import wire
from torchtop.contract.logcodes import SAMPLE_PHASES
from torchtop.monitor.link.client import Received
from torchtop.monitor.tui.feed import BatchesReceived, HelloReceived
from torchtop.monitor.tui.widgets import VerdictPanel, WhyPanel

OTHER = SAMPLE_PHASES.index("other")  # a stack sample's phase index
SITE = "/home/u/train.py:88 log_metrics"
ITEM = "/home/u/train.py:57 main"


def why_batch(sync: bool) -> BatchesReceived:
    recs = steps(n=60, data=0.0, wall_ms=40.0)
    for s in recs:
        s.phases = {"data": 0, "h2d": 0, "forward": 4_000_000, "backward": 5_000_000, "optimizer": 1_000_000, "other": 30_000_000}  # fmt: skip
        s.device_ms = {"forward": 3.0, "backward": 4.0, "optimizer": 1.0, "step": 40.0}
    plan = (
        [(OTHER, ITEM, "", True)] * 3 + [(OTHER, SITE, "wandb.sdk.wandb_run:Run.log", False)]
        if sync
        else [(OTHER, SITE, "wandb.sdk.wandb_run:Run.log", False)]
    )
    samples = [
        wire.StackSample(int((s.t0 + s.wall_ns / 2e9) * 1e9), *plan[k % len(plan)])
        for k, s in enumerate(recs)
    ]
    why = wire.Why(
        stacks=samples,
        stack_hz=20.0,
        sync=wire.SyncInfo(
            state="idle", windows=1, sites=[wire.SyncSite(ITEM, "loss.item()", "", "", 60, 60)]
        ),
        flops=wire.FlopInfo(
            state="done", source="counted", flops=int(4e12), by_dtype={"bfloat16": int(4e12)}, samples=256
        ),
    )
    end = recs[-1].t0 + recs[-1].wall_ns / 1e9
    tel = wire.Telemetry(time=end, gpus=[wire.GpuSample(index=0, util_gpu=99.0)])
    b = wire.Batch(
        v=wire.PROTOCOL_VERSION, run_id="run000000001", seq=1, time=end + 0.05, telemetry=tel, why=why
    )
    return BatchesReceived([Received(b, recs)])


@pytest.mark.slow  # among the fast subset's slowest, ~2.5 s here (issue 27: the subset under 60 s)
async def test_why_panel_shows_mfu_gpu_busy_sync_and_hot_code() -> None:
    app = app_without_feed()
    async with app.run_test(size=(140, 60)) as pilot:
        await fed(pilot, HelloReceived(hello(device_name="NVIDIA H100 80GB HBM3")), why_batch(sync=True))
        text = app.query_one(WhyPanel).plain()
        assert "25.0 steps/s · 6.4k samples/s (batch shape)" in text
        assert "100 TFLOP/s achieved (4 TFLOP a step) · MFU 10.1% of 989 TFLOP/s (H100 SXM bf16" in text
        assert "GPU kernels span 20.0% of the step (CUDA events) · NVML utilisation 99%" in text
        # one window (window.py): the panel reads the verdict's 50 steps past warm-up, 37 of 50 samples
        assert "sync loss.item() at train.py:57 main waits ~29.6 ms a step (74.0%)" in text
        assert "other 75.0% 74% train.py:57 main · 26% train.py:88 log_metrics → wandb…Run.log" in text
        verdict = app.query_one(VerdictPanel).plain()
        assert "Sync stalls  critical" in verdict
        # the verdict: the same steps and figures as the panel
        assert (
            "`loss.item()` at train.py:57 main waits ~29.6 ms a step for the GPU (74% of the step" in verdict
        )
        assert (
            "the GPU then idles ~32.0 ms a step while Python runs (CUDA events: busy 8.0 of 40.0 ms)"
            in verdict
        )
        assert "↑ not waiting on the GPU: ~3.8× steps/s (40.0 → 10.4 ms a step; estimate" in verdict


@pytest.mark.slow  # among the fast subset's slowest, ~2.8 s here (issue 27: the subset under 60 s)
async def test_host_code_verdict_names_the_site_with_its_upside() -> None:
    app = app_without_feed()
    async with app.run_test(size=(140, 60)) as pilot:
        await fed(pilot, HelloReceived(hello(device_name="NVIDIA H100 80GB HBM3")), why_batch(sync=False))
        verdict = app.query_one(VerdictPanel).plain()
        assert "Host-code bound  critical" in verdict
        assert "100% in train.py:88 log_metrics → wandb…Run.log" in verdict
        assert "↑ taking train.py:88 log_metrics off the step: ~4.0× steps/s" in verdict
