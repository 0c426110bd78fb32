"""A torch.profiler session of ours ends with CUPTI finalized, where that is safe.

Kineto leaves CUPTI attached after a profiler session unless TEARDOWN_CUPTI=1 is in the
environment when the session's trace stops, and an attached CUPTI keeps its callbacks on every
kernel launch: pytorch #144455 measured training 10-20% slower after a session ended. Kineto reads
the variable three times (libkineto's `cuptiTearDown_`): when the trace stops (inside the
`prof.step()` whose schedule ends the session, not in a later `prof.stop()`); on its teardown
thread after CUPTI is finalized, which re-subscribes the callbacks unless the variable is still
set; and at the next session's start, to re-subscribe them lazily. So once a capture of ours may
tear down, TEARDOWN_CUPTI=1 is set before its last step and stays set: set only for the call, the
finalize was undone at once (a capture left the launch-bound loop +21.6% slower, as with no
teardown at all). torch leaves it off because CUDA graphs crash on CUPTI's re-initialisation after
a teardown (torch/profiler/profiler.py sets TEARDOWN_CUPTI=0 when inductor's CUDA graphs are on).
A session of ours ends without teardown (`teardown_refusal` says why), our setting removed, when:
- TEARDOWN_CUPTI was set by someone else (the user, or torch for CUDA graphs): theirs to decide;
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
_ours = False  # TEARDOWN_CUPTI=1 in the environment is our setting, from an earlier capture


def cuda_graphs_in_use(torch: Any) -> str:
    """Why CUDA graphs look in use in this process ("" when nothing says so)."""
    try:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return "a CUDA graph is being captured"
    except Exception:  # broad: a torch that cannot say is taken as capturing no graph
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
    if ENV in os.environ and not _ours:
        return f"{ENV}={os.environ[ENV]} is set already"
    if os.environ.get("DISABLE_CUPTI_LAZY_REINIT"):
        return "DISABLE_CUPTI_LAZY_REINIT is set (CUDA graphs)"
    return cuda_graphs_in_use(torch)


def stop(prof: Any, torch: Any, cuda_activity: bool, last_step: bool = False) -> str:
    """End `prof`'s session (on the thread that started it): `prof.step()` first where
    `last_step` (the step at which its schedule stops the trace), then `prof.stop()`; with
    TEARDOWN_CUPTI=1 set beforehand where `teardown_refusal` allows, and left set (see above).
    Returns the refusal ("" when CUPTI goes with the session)."""
    global _ours
    refusal = teardown_refusal(torch, cuda_activity)
    if not refusal:
        os.environ[ENV] = "1"
        _ours = True
    elif _ours and cuda_activity:  # our setting from an earlier capture: not for this session
        os.environ.pop(ENV, None)
        _ours = False
    if last_step:
        prof.step()
    prof.stop()
    return refusal
