"""Top allocation sites of a CUDA memory snapshot (torch.cuda.memory._snapshot()). Pure Python."""

from __future__ import annotations

import os
from typing import Any

_SKIP = ("/torch/", "/torchtop/", "<frozen", "contextlib.py", "threading.py", "site-packages/")
_OURS = os.path.dirname(os.path.abspath(__file__))  # torchtop's agent, wherever it is installed


def _is_user_frame(filename: str) -> bool:
    """A Python file of the user's: not C++ (allocator, snapshot code), not torch, not us."""
    return (
        filename.endswith(".py") and not filename.startswith(_OURS) and not any(s in filename for s in _SKIP)
    )


def site_of(frames: list[dict[str, Any]]) -> str:
    """The innermost frame in the user's Python code; else the innermost Python frame."""
    for fr in frames:
        if _is_user_frame(str(fr.get("filename", ""))):
            return f"{fr.get('filename')}:{fr.get('line', '?')} {fr.get('name', '')}".strip()
    for fr in frames:
        if str(fr.get("filename", "")).endswith(".py"):
            return f"{fr.get('filename')}:{fr.get('line', '?')} {fr.get('name', '')}".strip()
    return "(no Python frame: the autograd backward thread or torch internals)"


def top_allocation_sites(snapshot: dict[str, Any], n: int = 10) -> list[dict[str, Any]]:
    """Sites by bytes allocated during the recording window (alloc actions of device traces)."""
    totals: dict[str, list[int]] = {}
    for trace in snapshot.get("device_traces", []) or []:
        for entry in trace:
            if entry.get("action") != "alloc":
                continue
            site = site_of(entry.get("frames", []) or [])
            t = totals.setdefault(site, [0, 0])
            t[0] += int(entry.get("size", 0))
            t[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: kv[1][0], reverse=True)[:n]
    return [{"site": site, "bytes": b, "allocs": count} for site, (b, count) in ranked]
