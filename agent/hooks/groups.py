"""Which process group a collective runs on, by name: the `comm` phase split by group.

A collective of torch.distributed called with `group=` logs, on timed steps, a COMM_GROUP entry
right after its COMM one, naming the group: the device mesh's dimension where the group is one
(DeviceMesh describes its groups `mesh_<dim>`: dp, tp, pp, ep, ...), `world` for the default
group, else the group's own name. Names are cached by the group object's id (groups live as long
as the job), so a timed call costs a dict lookup and two appends.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any

from torchtop.contract.logcodes import COMM_GROUP

if TYPE_CHECKING:
    from torchtop.agent.hooks.probe import Probe

# id(group) -> (the group, its name): the group is held so that its id is not reused by another
_names: dict[int, tuple[Any, str]] = {}
# device meshes made since start (a mesh that spans the world reuses the default group, whose
# description then says nothing of the mesh: the mesh names it)
_meshes: list[weakref.ref[Any]] = []


def watch_meshes(torch: Any, setattr_: Callable[[Any, str, Any], None]) -> None:
    """Keep each DeviceMesh made from now on (weakly), to name its groups by its dimensions."""
    cls = getattr(getattr(getattr(torch, "distributed", None), "device_mesh", None), "DeviceMesh", None)
    init = getattr(cls, "__init__", None)
    if cls is None or init is None:
        return

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        try:
            _meshes[:] = [m for m in _meshes if m() is not None]  # meshes gone (a test, a restart)
            if len(_meshes) < 64:
                _meshes.append(weakref.ref(self))
        except Exception:  # broad: mesh names are optional; the user's mesh is made regardless
            pass

    try:
        setattr_(cls, "__init__", __init__)
    except Exception:  # broad: a class that refuses the patch: meshes stay unnamed
        pass


def _mesh_dim(group: Any) -> str | None:
    for ref in _meshes:
        mesh = ref()
        if mesh is None:
            continue
        for i, name in enumerate(getattr(mesh, "mesh_dim_names", None) or ()):
            try:
                if mesh.get_group(i) is group:
                    return str(name)
            except Exception:  # broad: a mesh that cannot say: the dimension stays unnamed
                break
    return None


def group_name(group: Any) -> str:
    """`dp`, `tp`, ... for a device mesh's group; `world` for the default one."""
    dim = _mesh_dim(group if group is not None else _default())
    if dim is not None:
        return dim
    if group is None:
        return "world"
    desc = str(getattr(group, "group_desc", "") or "")
    if desc.startswith("mesh_") and desc != "mesh_default":
        return desc[5:]
    try:
        import torch.distributed as dist

        if group is dist.group.WORLD or desc == "default_pg":
            return "world"
    except Exception:  # broad: torch internals vary by version: the group stays unnamed
        pass
    return desc or str(getattr(group, "group_name", "") or "group")


def _default() -> Any:
    try:
        import torch.distributed as dist

        return dist.group.WORLD
    except Exception:  # broad: no usable distributed in this torch: no default group
        return None


def log_group(probe: Probe, group: Any) -> None:
    """Training thread, a timed collective: one COMM_GROUP entry (the caller catches)."""
    key = group if group is not None else _default()  # the default group: the one in force now
    hit = _names.get(id(key))
    if hit is not None and hit[0] is key:
        name = hit[1]
    else:
        name = group_name(key)
        if len(_names) < 1024:
            _names[id(key)] = (key, name)
    a = probe._append  # a tuple: never an event
    a(perf_counter_ns())
    a((COMM_GROUP, name))
