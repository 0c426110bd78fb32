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
    COMPILED = 5  # code torch generated (inductor's output files, FX's <eval_with_key>): not the user's


#: A frame's third item for a wrapper of torch's, a library's or the stdlib's (a decorator's
#: `<locals>` closure, nn.Module's call): looked through, the function it wraps is what is called.
WRAPS = -2
#: ... and for a function (the user's, a package's, nn.Sequential's) that torch.compile runs: dynamo's
#: transformed code, which calls its graph (a `__compiled_fn_*` global).
COMPILED_FN = -3
#: A `<locals>` closure by these names, in torch, a library or the stdlib, only calls what it wraps:
#: torch.optim's profile_hook_step wrapper and _use_grad, dynamo's _fn / inner / compile_wrapper,
#: _contextlib's decorate_context, lr_scheduler's wrap_step wrapper, contextlib's inner.
WRAPPER_NAMES = frozenset(
    (
        "wrapper",
        "inner",
        "_fn",
        "fn",
        "g",
        "decorate_context",
        "decorate_autocast",
        "_use_grad",
        "wrapped",
        "_wrapper",
        "compile_wrapper",
    )
)
WRAPPER_QUALNAMES = frozenset(("Module._wrapped_call_impl", "Module._call_impl", "OptimizedModule.__call__"))
# inductor's cache: $TMPDIR/torchinductor_<user>/ (or TORCHINDUCTOR_CACHE_DIR)
GENERATED_DIR = "torchinductor_"
PACKAGE_DIRS = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")


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
        cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        self.generated = _dir(cache) if cache else "\0"
        # keyed by id(): a code object's own hash is computed afresh from its contents at every
        # lookup (tens of microseconds a stack on a cold cache). The entry holds the code, so
        # its id is not reused while the entry exists, and is checked against it.
        self._cache: dict[int, tuple[CodeType, Kind, int]] = {}
        self._names: dict[int, str] = {}

    def kind(self, code: CodeType) -> tuple[CodeType, Kind, int]:
        """(code, kind, phase of a wrapper of ours, WRAPS for a wrapper of others', COMPILED_FN, or -1)."""
        got = self._cache.get(id(code))
        if got is None or got[0] is not code:
            if len(self._cache) > CACHE_CAP:
                self._cache.clear()
                self._names.clear()
            kind = self._kind_of(code.co_filename)
            got = (code, kind, WRAPPER_PHASES.get(code, -1) if kind is Kind.OURS else _wraps(code, kind))
            self._cache[id(code)] = got
        return got

    def _kind_of(self, filename: str) -> Kind:
        if filename.startswith("<"):
            if filename.startswith("<torchtop "):
                return Kind.OURS
            if filename.startswith("<eval_with_key>"):
                return Kind.COMPILED
            return Kind.STDLIB if filename.startswith("<frozen") else Kind.USER
        path = os.path.realpath(filename)
        if path.startswith(self.ours):
            return Kind.OURS
        if path.startswith(self.torch):
            return Kind.TORCH
        if path.startswith(self.libs) or any(d in path for d in PACKAGE_DIRS):
            return Kind.LIB  # a package's, on sys.path or not (a path added later, another env's)
        if path.startswith(self.stdlib):
            return Kind.STDLIB
        if path.startswith(self.generated) or GENERATED_DIR in path:
            return Kind.COMPILED
        return Kind.USER

    def callee(self, frame: FrameType) -> str:
        """ "module:qualname" of the function a frame runs."""
        code = frame.f_code
        name = self._names.get(id(code)) if self.kind(code)[0] is code else None
        if name is None:
            module = frame.f_globals.get("__name__", "?")
            name = self._names[id(code)] = f"{module}:{getattr(code, 'co_qualname', code.co_name)}"
        return name


def _wrapper_name(name: str) -> bool:
    """A closure's name that says it wraps: one of WRAPPER_NAMES, `*_wrapper` (clip_grad's
    `_no_grad_wrapper`), `wrapped*` (transformers' `deprecate_kwarg` `wrapped_func`)."""
    return name in WRAPPER_NAMES or name.endswith("_wrapper") or name.startswith("wrapped")


def _wraps(code: CodeType, kind: Kind) -> int:
    """WRAPS where `code` (not the user's) only wraps another function, COMPILED_FN where it is
    dynamo's transformed code of a compiled function, else -1."""
    if kind in (Kind.USER, Kind.LIB, Kind.TORCH) and any(
        n.startswith("__compiled_fn") for n in code.co_names
    ):
        return COMPILED_FN
    if kind not in (Kind.TORCH, Kind.LIB, Kind.STDLIB):
        return -1
    qual = getattr(code, "co_qualname", code.co_name)
    if qual in WRAPPER_QUALNAMES or (".<locals>." in qual and _wrapper_name(code.co_name)):
        return WRAPS
    return -1


def site(frame: FrameType) -> str:
    """ "path:line qualname" of where a frame is."""
    code = frame.f_code
    return f"{code.co_filename}:{frame.f_lineno} {getattr(code, 'co_qualname', code.co_name)}"


def classifier_for(torch: Any) -> Classifier:
    """The classifier of this process: torch's package and torchtop's agent package."""
    import torchtop.agent

    torch_dir = os.path.dirname(getattr(torch, "__file__", "") or "") or None
    return Classifier(torch_dir, os.path.dirname(torchtop.agent.__file__))
