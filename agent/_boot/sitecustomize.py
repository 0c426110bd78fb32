"""torchtop's bootstrap for `torchtop run`: arms the agent's autostart, then runs whatever
sitecustomize the environment had before ours was put first on PYTHONPATH."""

import importlib.machinery
import importlib.util
import os
import sys


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    ours = sys.modules.pop("sitecustomize", None)
    try:
        for entry in sys.path:
            if os.path.abspath(entry or os.curdir) == here:
                continue
            spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [entry])
            if spec is not None and spec.loader is not None:
                module = importlib.util.module_from_spec(spec)
                sys.modules["sitecustomize"] = module
                spec.loader.exec_module(module)
                return
    except Exception as exc:  # broad: the environment's own sitecustomize may fail any way; ours still runs
        print(f"torchtop: the environment's own sitecustomize failed: {exc}", file=sys.stderr)
    finally:
        if "sitecustomize" not in sys.modules and ours is not None:
            sys.modules["sitecustomize"] = ours


try:
    from torchtop.agent.autostart import arm

    arm()
except Exception as exc:  # broad: torchtop missing in this interpreter: run the program anyway
    if os.environ.get("TORCHTOP"):
        print(f"torchtop: cannot start the agent in {sys.executable} ({exc})", file=sys.stderr)
_chain()
