"""Zero-code start: `TORCHTOP=1` (set by `torchtop run`, or by hand) starts the agent in any
Python process that imports torch, right after torch's import finishes.

Armed from `torchtop_autostart.pth` (installed beside the package) or from the `sitecustomize`
that `torchtop run` puts on PYTHONPATH. Waiting for torch's import keeps processes that never
touch torch (pip, a launcher's helpers) untouched, and skips launchers such as `torchrun`
itself, whose workers get their own agents.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from typing import Any

_armed = False
_LAUNCHERS = (
    "torchrun",
    os.path.join("torch", "distributed", "run.py"),
    os.path.join("torch", "distributed", "launch.py"),
    os.path.join("torch", "_inductor", "compile_worker", "__main__.py"),  # torch.compile's workers
)


def enabled() -> bool:
    return os.environ.get("TORCHTOP", "").strip().lower() in ("1", "true", "yes", "on")


def is_launcher(argv: list[str], orig_argv: list[str] | None = None) -> bool:
    """torchrun / torch.distributed.run|launch itself (its workers get agents, it does not).

    Under `python -m`, torch is imported while the module is still being found, when argv[0]
    is only "-m": the interpreter's original command line (sys.orig_argv) still names it.
    """
    first = argv[0] if argv else ""
    if first.endswith(_LAUNCHERS):
        return True
    orig = orig_argv or []
    for i, word in enumerate(orig[:-1]):
        if word == "-m" and orig[i + 1] in ("torch.distributed.run", "torch.distributed.launch"):
            return True
    return False


def _start() -> None:
    if is_launcher(list(getattr(sys, "argv", []) or []), list(getattr(sys, "orig_argv", []) or [])):
        return
    try:
        import torchtop.agent

        port = os.environ.get("TORCHTOP_PORT")
        if port and port.isdigit():  # one port per local rank under torchrun (0: free ones)
            base = int(port) + 2 * int(os.environ.get("LOCAL_RANK", "0") or 0) if int(port) else 0
            torchtop.agent.start(port=base, publish_when_active=True)
        else:
            torchtop.agent.start(publish_when_active=True)
    except Exception as exc:  # broad: never into the user's program
        try:
            print(f"torchtop: autostart failed ({type(exc).__name__}: {exc})", file=sys.stderr)
        except Exception:  # broad: stderr may be closed; never into the user's program
            pass


class _AfterTorchImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps torch's loader so the agent starts once torch is imported."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "torch":
            return None
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module: Any) -> None:
            original(module)
            loader.exec_module = original  # type: ignore[method-assign]
            _start()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def arm() -> None:
    """Start now if torch is imported, else right after it is. Idempotent; never raises."""
    global _armed
    if _armed or not enabled():
        return
    _armed = True
    try:
        if "torch" in sys.modules:
            _start()
        else:
            sys.meta_path.insert(0, _AfterTorchImport())
    except Exception:  # broad: autostart is optional; never into the user's program
        pass
