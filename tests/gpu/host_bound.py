"""Host-bound jobs on 2+ GPUs, in the shape of the public examples: the job verdict must say
`host-bound`, name no straggler and promise no upside above 1.1x (issue 35).

    torchrun --nproc_per_node 2 tests/gpu/host_bound.py --parallel fsdp
    torchrun --nproc_per_node 2 tests/gpu/host_bound.py --parallel tp

`fsdp`: pytorch/examples' FSDP2 example's shape: a 10-block transformer of width 16, `fully_shard`
per block and on the root, AdamW, `clip_grad_norm_` over the DTensor parameters: every rank's host
is busy dispatching DTensor ops the whole step while each GPU does ~1-3 ms of work. `tp`: the
tensor-parallel example's shape: a small MLP, ColwiseParallel / RowwiseParallel on a 1-D mesh.
Rank 0 asks for a job report (`torchtop report --job`, a separate process, as a user would) while
every rank trains. Exit code 0 when the verdict is host-bound with no straggler and no upside
above 1.1x, else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    def __init__(self, vocab: int = 1024, dim: int = 16, layers: int = 10, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.out(self.norm(x))


class ToyMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.in_proj = nn.Linear(10, 32)
        self.relu = nn.ReLU()
        self.out_proj = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.relu(self.in_proj(x)))


def build(parallel: str, device: torch.device) -> tuple[nn.Module, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        model = Transformer().to(device)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        model = parallelize_module(
            ToyMLP().to(device), mesh, {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()}
        )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)


def step(parallel: str, model: nn.Module, opt: Any, device: torch.device) -> None:
    if parallel == "fsdp":
        tokens = torch.randint(0, 1024, (8, 64), device=device)
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    else:
        torch.manual_seed(0)  # tensor parallel: the same input on every rank
        loss = model(torch.rand(20, 10, device=device)).sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()


def run_report(seconds: float, job_id: str, out: dict[str, Any]) -> None:
    cli = [sys.executable, "-m", "torchtop.monitor.commands.cli", "report", "--seconds", str(seconds)]
    proc = subprocess.run([*cli, "--job", job_id], capture_output=True, text=True, timeout=300)
    out["code"], out["stderr"] = proc.returncode, proc.stderr
    out["report"] = json.loads(proc.stdout) if proc.returncode == 0 else None


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--parallel", choices=("fsdp", "tp"), default="fsdp")
    p.add_argument("--warm-s", type=float, default=12.0)
    p.add_argument("--report-seconds", type=float, default=10.0)
    args = p.parse_args()
    os.environ.setdefault("TORCHTOP_QUIET", "1")
    import torchtop.agent as ta

    cuda = torch.cuda.is_available()  # gloo on CPU: the same job, to try the script without a GPU
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    agent = ta.start()
    assert agent is not None
    model, opt = build(args.parallel, device)
    flag = torch.zeros(1, device=device)
    t0 = time.perf_counter()
    n = 0
    while True:  # every rank runs the same steps: rank 0's clock decides, for all, every 5 steps
        for _ in range(5):
            step(args.parallel, model, opt, device)
        n += 5
        flag.fill_(1.0 if rank == 0 and time.perf_counter() - t0 > args.warm_s else 0.0)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            break
    if cuda:
        torch.cuda.synchronize()
    print(f"rank {rank}: {n / (time.perf_counter() - t0):.1f} steps/s in the warm-up", flush=True)
    found: dict[str, Any] = {}
    reporter = threading.Thread(
        target=run_report, args=(args.report_seconds, agent.identity.job_id, found), daemon=True
    )
    if rank == 0:
        reporter.start()
    while True:
        for _ in range(5):
            step(args.parallel, model, opt, device)
        flag.fill_(1.0 if rank == 0 and not reporter.is_alive() else 0.0)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            break
    ok = True
    if rank == 0:
        report = found.get("report")
        if report is None:
            print(f"torchtop report failed: {found.get('stderr', '')[-2000:]}", flush=True)
            ok = False
        else:
            v, s = report["verdict"], report["straggler"]
            up = (v.get("upside") or {}).get("speedup")
            print(f"verdict: {v['kind']} {v['severity']}: {json.dumps(v['evidence'])}", flush=True)
            print(f"upside: {json.dumps(v.get('upside'))}; straggler: {json.dumps(s)}", flush=True)
            for e in report["ranks"]:
                print(
                    f"rank {e['rank']}: step {e['step_time_ms']}, phases {e['phase_ms']}, "
                    f"device {e['device_ms']}, own verdict {e['verdict']['kind']}",
                    flush=True,
                )
            ok = v["kind"] == "host-bound" and s is None and (up is None or up <= 1.1)
            print("PASS" if ok else "FAIL", flush=True)
    flag.fill_(0.0 if ok else 1.0)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    code = int(flag.item() > 0)
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
