"""Whose code a frame runs, and where: the frame classification shared by the stack sampler
(agent/telemetry/stacks.py, on its own thread) and the sync windows (sync_window.py, on the
training thread), so the training thread imports only what it runs."""

from __future__ import annotations

import os
import sys
import sysconfig
from enum import IntEnum
from types import CodeType, FrameType
from typing import Any

from torchtop.agent.hooks.wrap import WRAPPER_PHASES

CACHE_CAP = 20_000  # code objects classified (a strong reference each): cleared past this


class Kind(IntEnum):
    """Whose code a frame runs."""

    OURS = 0  # torchtop's: transparent (its wrappers say the phase)
    TORCH = 1
    STDLIB = 2
    LIB = 3  # an installed package (site-packages)
    USER = 4  # everything else: the user's own code


def _dir(path: str | None) -> str:
    return os.path.join(os.path.realpath(path), "") if path else "\0"


class Classifier:
    """Kind, phase and names of a code object, cached per code object (shared by threads: a
    dict's get and set are atomic under the GIL)."""

    def __init__(self, torch_dir: str | None, ours_dir: str | None) -> None:
        paths = sysconfig.get_paths()
        self.ours = _dir(ours_dir)
        self.torch = _dir(torch_dir)
        libs = {paths.get("purelib"), paths.get("platlib")}
        libs |= {p for p in sys.path if p.endswith(("site-packages", "dist-packages"))}
        self.libs = tuple(_dir(p) for p in libs if p)
        self.stdlib = tuple(_dir(p) for p in {paths.get("stdlib"), paths.get("platstdlib")} if p)
        # keyed by id(): a code object's own hash is computed afresh from its contents at every
        # lookup (tens of microseconds a stack on a cold cache). The entry holds the code, so
        # its id is not reused while the entry exists, and is checked against it.
        self._cache: dict[int, tuple[CodeType, Kind, int]] = {}
        self._names: dict[int, str] = {}

    def kind(self, code: CodeType) -> tuple[CodeType, Kind, int]:
        """(code, kind, phase of a wrapper of ours or -1)."""
        got = self._cache.get(id(code))
        if got is None or got[0] is not code:
            if len(self._cache) > CACHE_CAP:
                self._cache.clear()
                self._names.clear()
            got = (code, self._kind_of(code.co_filename), WRAPPER_PHASES.get(code, -1))
            self._cache[id(code)] = got
        return got

    def _kind_of(self, filename: str) -> Kind:
        if filename.startswith("<"):
            if filename.startswith("<torchtop "):
                return Kind.OURS
            return Kind.STDLIB if filename.startswith("<frozen") else Kind.USER
        path = os.path.realpath(filename)
        if path.startswith(self.ours):
            return Kind.OURS
        if path.startswith(self.torch):
            return Kind.TORCH
        if path.startswith(self.libs):
            return Kind.LIB
        if path.startswith(self.stdlib):
            return Kind.STDLIB
        return Kind.USER

    def callee(self, frame: FrameType) -> str:
        """ "module:qualname" of the function a frame runs."""
        code = frame.f_code
        name = self._names.get(id(code)) if self.kind(code)[0] is code else None
        if name is None:
            module = frame.f_globals.get("__name__", "?")
            name = self._names[id(code)] = f"{module}:{getattr(code, 'co_qualname', code.co_name)}"
        return name


def site(frame: FrameType) -> str:
    """ "path:line qualname" of where a frame is."""
    code = frame.f_code
    return f"{code.co_filename}:{frame.f_lineno} {getattr(code, 'co_qualname', code.co_name)}"


def classifier_for(torch: Any) -> Classifier:
    """The classifier of this process: torch's package and torchtop's agent package."""
    import torchtop.agent

    torch_dir = os.path.dirname(getattr(torch, "__file__", "") or "") or None
    return Classifier(torch_dir, os.path.dirname(torchtop.agent.__file__))
