"""Which processes of a training job get an agent: not DataLoader workers, and a spawned child
only once it is known what it runs.

A child started by multiprocessing's spawn or forkserver method imports torch while it unpickles
its target (and re-imports the main module), before it knows whether it is a rank (mp.spawn's
`_wrap`) or a DataLoader worker (`_worker_loop`). So a start asked for then waits until the
child runs its target, and is dropped in a loader worker. Forked workers drop the parent's agent
(core.py, at fork). Imports neither torch nor multiprocessing itself: it looks at what is loaded.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

LOADER_WORKER_MODULE = "torch.utils.data._utils.worker"
_pending: list[Callable[[], object]] = []


def loader_worker() -> bool:
    """This process is a DataLoader worker (torch.utils.data.get_worker_info() is set)."""
    worker = sys.modules.get(LOADER_WORKER_MODULE)
    return worker is not None and getattr(worker, "_worker_info", None) is not None


def setting_up() -> bool:
    """A multiprocessing child (spawn, forkserver) still unpickling what it is to run."""
    process = sys.modules.get("multiprocessing.process")
    try:
        return process is not None and bool(getattr(process.current_process(), "_inheriting", False))
    except Exception:  # broad: multiprocessing internals vary: not setting up
        return False


def runs_loader(target: Any) -> bool:
    return getattr(target, "__module__", "") == LOADER_WORKER_MODULE


def when_set_up(start: Callable[[], object]) -> None:
    """Call `start` when this child begins to run its target, unless it is a loader worker."""
    _pending.append(start)
    if len(_pending) > 1:
        return
    from multiprocessing.process import BaseProcess

    original = BaseProcess.__dict__["_bootstrap"]

    def _bootstrap(self: Any, *args: Any, **kwargs: Any) -> Any:
        BaseProcess._bootstrap = original  # type: ignore[method-assign]
        starts = list(_pending)
        _pending.clear()
        if not runs_loader(getattr(self, "_target", None)):
            run = self.run

            def run_watched() -> Any:  # the child's own run, after multiprocessing's set-up
                for fn in starts:
                    try:
                        fn()
                    except Exception:  # broad: a watcher never breaks the child's start
                        pass
                return run()

            self.run = run_watched
        return original(self, *args, **kwargs)

    BaseProcess._bootstrap = _bootstrap  # type: ignore[method-assign]
