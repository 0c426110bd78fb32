"""Which process group a collective runs on, by name: the `comm` phase split by group.

A collective of torch.distributed called with `group=` logs, on timed steps, a COMM_GROUP entry
right after its COMM one, naming the group: the device mesh's dimension where the group is one
(DeviceMesh describes its groups `mesh_<dim>`: dp, tp, pp, ep, ...), `world` for the default
group, else the group's own name. Names are cached by the group object's id (groups live as long
as the job), so a timed call costs a dict lookup and two appends.
"""

from __future__ import annotations

from time import perf_counter_ns
from typing import TYPE_CHECKING, Any

from torchtop.agent.contract.logcodes import COMM_GROUP

if TYPE_CHECKING:
    from torchtop.agent.hooks.probe import Probe

_names: dict[int, str] = {}


def group_name(group: Any) -> str:
    """`dp`, `tp`, ... for a device mesh's group; `world` for the default one."""
    if group is None:
        return "world"
    desc = str(getattr(group, "group_desc", "") or "")
    if desc.startswith("mesh_") and desc != "mesh_default":
        return desc[5:]
    try:
        import torch.distributed as dist

        if group is dist.group.WORLD or desc == "default_pg":
            return "world"
    except Exception:
        pass
    return desc or str(getattr(group, "group_name", "") or "group")


def log_group(probe: Probe, group: Any) -> None:
    """Training thread, a timed collective: one COMM_GROUP entry (the caller catches)."""
    name = _names.get(id(group))
    if name is None:
        name = _names[id(group)] = group_name(group)
    a = probe._append  # a tuple: never an event
    a(perf_counter_ns())
    a((COMM_GROUP, name))
