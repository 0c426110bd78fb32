"""A torch.profiler session of ours ends with CUPTI finalized, where that is safe.

Kineto leaves CUPTI attached after a profiler session unless TEARDOWN_CUPTI=1 is in the
environment when the session stops (read at that moment: libkineto's `cuptiTearDown_`), and an
attached CUPTI keeps its callbacks on every kernel launch: pytorch #144455 measured training
10-20% slower after a session ended. torch leaves it off because CUDA graphs crash on CUPTI's
re-initialisation after a teardown (torch/profiler/profiler.py sets TEARDOWN_CUPTI=0 when
inductor's CUDA graphs are on). So a capture of ours stops its profiler with TEARDOWN_CUPTI=1
set for the call only, unless (`teardown_refusal` says which):
- TEARDOWN_CUPTI is already set (by the user, or by torch for CUDA graphs): theirs to decide;
- DISABLE_CUPTI_LAZY_REINIT is set (torch's sign of CUDA graphs with an older CUDA);
- CUDA graphs are in use: a stream capturing now, inductor's `triton.cudagraphs` on, or its
  CUDA-graph trees loaded (torch.compile(mode="reduce-overhead"));
- the session recorded no CUDA activity (CUPTI was never attached), or TORCHTOP_CUPTI_TEARDOWN=0.
A run that makes its own `torch.cuda.CUDAGraph` outside torch.compile is not seen here: it sets
TORCHTOP_CUPTI_TEARDOWN=0 (docs/benchmarks.md says what a capture costs afterwards either way).
"""

from __future__ import annotations

import os
import sys
from typing import Any

ENV = "TEARDOWN_CUPTI"
OPT_OUT = "TORCHTOP_CUPTI_TEARDOWN"


def cuda_graphs_in_use(torch: Any) -> str:
    """Why CUDA graphs look in use in this process ("" when nothing says so)."""
    try:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return "a CUDA graph is being captured"
    except Exception:
        pass
    config = sys.modules.get("torch._inductor.config")
    if config is not None and getattr(getattr(config, "triton", None), "cudagraphs", False):
        return "torch.compile's CUDA graphs are on (inductor triton.cudagraphs)"
    if "torch._inductor.cudagraph_trees" in sys.modules:
        return "torch.compile's CUDA graph trees are loaded (mode='reduce-overhead')"
    return ""


def teardown_refusal(torch: Any, cuda_activity: bool) -> str:
    """ "" when our session may end with CUPTI torn down, else why not."""
    if not cuda_activity:
        return "no CUDA activity was recorded"
    if os.environ.get(OPT_OUT, "").strip() == "0":
        return f"{OPT_OUT}=0"
    if ENV in os.environ:
        return f"{ENV}={os.environ[ENV]} is set already"
    if os.environ.get("DISABLE_CUPTI_LAZY_REINIT"):
        return "DISABLE_CUPTI_LAZY_REINIT is set (CUDA graphs)"
    return cuda_graphs_in_use(torch)


def stop(prof: Any, torch: Any, cuda_activity: bool) -> str:
    """Stop `prof` (on the thread that started it), with CUPTI torn down where
    `teardown_refusal` allows; returns the refusal ("" when torn down)."""
    refusal = teardown_refusal(torch, cuda_activity)
    if refusal:
        prof.stop()
        return refusal
    os.environ[ENV] = "1"
    try:
        prof.stop()
    finally:
        if os.environ.get(ENV) == "1":  # the setting lasts for our call only
            del os.environ[ENV]
    return ""
