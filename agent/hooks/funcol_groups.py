"""Which process group a functional collective's wait is for (tensor parallel's all-reduces).

DTensor and torch.distributed._functional_collectives issue a collective with its group and wait
for it later in `wait_tensor`, which is given only the tensor (an AsyncCollectiveTensor waits at
its first use). Every issuing function resolves its group through one helper (`_resolve_group`;
`_resolve_group_name` in older torch): on timed steps its result is kept on the probe
(`probe.funcol_group`), and the wait names it (a COMM_GROUP entry, groups.py) as the named
collectives do. Eagerly a collective's wait follows its issue; with several in flight at once
(overlapped async tensor parallel) the wait is named by the latest issued.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torchtop.agent.hooks.timed import dynamo_check

if TYPE_CHECKING:
    from types import ModuleType

    from torchtop.agent.hooks.probe import Probe

RESOLVERS = ("_resolve_group", "_resolve_group_name")  # the newer first
# a group's c10d name ("0", "1", ...) -> the group (names live as long as their groups)
_by_name: dict[str, Any] = {}

# the wait_tensor template's group entry (waits.py): only where an issue on a timed step named one
GROUP_ENTRY = (
    "        _tt_put(_tt_enter)\n"
    "        _tt_g = _tt_probe.funcol_group\n"
    "        if _tt_g is not None:\n"
    "            _tt_group(_tt_probe, _tt_g)\n"
)


def process_group(resolved: Any, torch: ModuleType) -> Any:
    """The ProcessGroup of a resolver's result (a group, or its c10d name); None if unknown."""
    if not isinstance(resolved, str):
        return resolved
    group = _by_name.get(resolved)
    if group is None:
        find = getattr(torch.distributed.distributed_c10d, "_resolve_process_group", None)
        try:
            group = find(resolved) if find is not None else None
        except Exception:  # broad: torch internals vary by version: group unknown
            group = None
        if group is not None and len(_by_name) < 1024:
            _by_name[resolved] = group
    return group


def patch_resolver(
    probe: Probe, torch: ModuleType, funcol: ModuleType, setattr_: Callable[..., None]
) -> bool:
    """Wrap funcol's group resolver so that a timed step's issue leaves its group on the probe.
    False where this torch has none (the waits then go unnamed, in `comm` only)."""
    for name in RESOLVERS:
        orig = getattr(funcol, name, None)
        if callable(orig):
            break
    else:
        return False
    dynamo = dynamo_check(torch)

    @functools.wraps(orig)
    def resolve(*args: Any, **kwargs: Any) -> Any:
        out = orig(*args, **kwargs)
        if not dynamo() and not probe.untimed:  # only a timed step's wait logs it; dynamo traces through
            try:
                probe.funcol_group = process_group(out, torch)
            except Exception:  # broad: never into the training loop (probe.fail counts it)
                probe.fail()
        return out

    setattr_(funcol, name, resolve)
    return True
