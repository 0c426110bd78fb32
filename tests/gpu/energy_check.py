"""Energy a step on a real GPU (issue 38, item 4): the recording's joules over a run against NVML's
total-energy counter read by hand around it.

    python tests/gpu/energy_check.py [seconds]

A bf16 matmul loop under the agent, recorded; NVML's counter read here right before the first step
and right after the last one (synchronized). The recording's report over the whole run (model/
energy.py) must give a total within 5% of that difference, and joules a step times the steps the
same total. Prints both; exit code 0 when they agree, 2 where the counter is not supported.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import pynvml
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torchtop.agent as ta  # noqa: E402
from torchtop.monitor.diagnosis.report import run_report  # noqa: E402
from torchtop.monitor.model.energy import window_energy  # noqa: E402
from torchtop.monitor.model.playback import load  # noqa: E402


def main() -> int:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 20.0
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    try:
        pynvml.nvmlDeviceGetTotalEnergyConsumption(h)
    except pynvml.NVMLError as exc:
        print(f"energy counter not supported: {exc}")
        return 2
    out = Path(tempfile.mkdtemp(prefix="energy-"))
    model = torch.nn.Sequential(*[torch.nn.Linear(8192, 8192, dtype=torch.bfloat16) for _ in range(4)]).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    x = torch.randn(512, 8192, device="cuda", dtype=torch.bfloat16)
    agent = ta.start(record=out)
    if agent is None:
        print("the agent did not start")
        return 1
    for _ in range(5):  # warm-up outside the measured span
        model(x).float().square().mean().backward()
    torch.cuda.synchronize()
    time.sleep(1.0)  # the agent's counter readings before the first step
    e0, t0 = pynvml.nvmlDeviceGetTotalEnergyConsumption(h), time.time()
    steps = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()
        torch.cuda.synchronize()  # the step's wall time is its GPU time
        steps += 1
    e1, t1 = pynvml.nvmlDeviceGetTotalEnergyConsumption(h), time.time()
    time.sleep(1.5)  # readings after the last step
    agent.stop()
    hand = (e1 - e0) / 1000.0
    playback, _ = load(out)
    state = playback.state_until(None)
    window = state.agent_time - t0 + 1e-3
    report = run_report(state, window, window=window)
    print(f"the report's energy over its window: {report.energy}")
    run = [s for s in state.steps if s.kind == "train" and s.t0 >= t0 - 0.05]
    e = window_energy(state.points, run)
    print(f"by hand: {hand:.1f} J over {t1 - t0:.2f} s ({hand / (t1 - t0):.0f} W), {steps} steps")
    print(f"points with energy: {sum(1 for p in state.points if p.energy)} of {len(state.points)}")
    if e is None or e.joules is None or e.joules_per_step is None:
        print(f"no energy: {report.gpu}")
        return 1
    print(
        f"torchtop: {e.joules:.1f} J over {e.span_s:.2f} s ({e.watts} W), {e.steps} steps, "
        f"{e.joules_per_step:.3f} J/step, {e.joules_per_sample} J/sample; sources {e.sources}"
    )
    ratio = e.joules / hand
    print(f"torchtop / by hand: {ratio:.4f}")
    return 0 if abs(ratio - 1) <= 0.05 and abs(e.steps - steps) <= 2 else 1


if __name__ == "__main__":
    sys.exit(main())
