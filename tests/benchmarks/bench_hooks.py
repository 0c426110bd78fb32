"""Where the agent's per-step cost goes: the CPU benchmark loop with one hook group removed at a
time (and the agent thread reduced to draining its buffer: `noproc`), modes interleaved round by
round, median of the per-round median step times.

    python tests/benchmarks/bench_hooks.py [ROUNDS]

Not collected by pytest. On an H100 host (16 cores, torch 2.11) one run gave: threads alone -0.9%,
full +19%, noproc +10%, without the h2d patches +6.7%, figures that disagree with
bench_overhead.py's +2.4% on the same loop: the next thing to explain.
"""
import cProfile
import io
import pstats
import statistics
import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import torchtop.agent as ta
from torchtop.agent import hooks as H

torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 320), torch.nn.ReLU(), torch.nn.Linear(320, 320), torch.nn.ReLU(), torch.nn.Linear(320, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
crit = torch.nn.CrossEntropyLoss()
ds = TensorDataset(torch.randn(64 * 400, 256), torch.randint(0, 10, (64 * 400,)))
def block(n):
    it = iter(DataLoader(ds, batch_size=64, shuffle=False))
    ts = []
    for _ in range(n):
        t = time.perf_counter_ns()
        x, y = next(it)
        loss = crit(model(x), y); opt.zero_grad(); loss.backward(); opt.step()
        ts.append(time.perf_counter_ns() - t)
    return statistics.median(ts) / 1000
from torchtop.agent import publisher as P

orig_tick = P.AgentLoop._tick
orig = {k: getattr(H.AutoHooks, k) for k in ("_patch_dataloader", "_hook_forward", "_patch_backward", "_patch_h2d", "_patch_grad_scaler", "_hook_optimizer")}
def mode(name):
    for k, v in orig.items():
        setattr(H.AutoHooks, k, v)
    P.AgentLoop._tick = orig_tick
    if name == "noproc":  # hooks on, the agent thread only drains the buffer
        P.AgentLoop._tick = lambda self, final=False: self.buffer.drain()
    if name.startswith("-"):
        setattr(H.AutoHooks, name[1:], lambda self: None)
modes = ["off", "threads", "full", "noproc", "-_patch_dataloader", "-_hook_forward", "-_patch_backward", "-_patch_h2d", "-_hook_optimizer"]
res = {m: [] for m in modes}
for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 25):
    for m in modes:
        if m == "off":
            block(10); res[m].append(block(80)); continue
        mode(m)
        ta.start(auto=(m != "threads")); block(10); res[m].append(block(80)); ta.stop()
base = statistics.median(res["off"])
for m in modes:
    v = statistics.median(res[m]); print(f"{m:22s} {v:8.1f} us/step  delta {v - base:+6.1f} us ({(v - base) / base * 100:+.2f}%)")
mode("full")
ta.start(); block(20)
pr = cProfile.Profile(); pr.enable(); block(200); pr.disable(); ta.stop()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("ncalls").print_stats("torchtop|hooks|recorder|api", 25); print(s.getvalue()[-4000:])
