"""What the TUI tests that run a real agent share: the training script and a bounded wait."""

from __future__ import annotations

import time

#: A small CPU training loop with the agent, for `seconds` (argv[1]); it marks its loss.
TRAIN = """
import sys, time, torch, torchtop.agent
torchtop.agent.start()
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(256, 32)), batch_size=16)
end = time.time() + float(sys.argv[1])
while time.time() < end:
    for (x,) in data:
        loss = model(x).square().mean()
        opt.zero_grad(); loss.backward(); opt.step()
        torchtop.agent.mark("loss", loss)
        time.sleep(0.005)
"""


async def wait_for(pilot, condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        await pilot.pause(0.2)
    return condition()
