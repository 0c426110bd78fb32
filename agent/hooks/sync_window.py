"""Sync windows: where the training thread makes the host wait for the GPU, found for a moment.

For a short window (WINDOW_S, announced once on stderr) the agent thread sets
`torch.cuda.set_sync_debug_mode("warn")`: torch then warns at every synchronising call
(`.item()`, `.cpu()`, `print(tensor)`, `nonzero()`, a boolean mask) and the warning surfaces in
the Python frame that made the call. A filter at the front of `warnings.filters` lets each one
through, and `warnings.showwarning` hands it here, on the training thread: the frame's code and
instruction offset name the call (a dict update, a few microseconds; measured: docs/why.md), and
nothing is printed. Outside the windows nothing of this runs: the stack sampler (stacks.py)
knows those calls from then on, and a sample that finds the training thread blocked at one is a
sample of time spent waiting on the device.

Never adds a synchronisation: the mode only makes torch report the ones the user's code makes.
A run that set a sync debug mode of its own is left alone (no window). Not used: torch's GPU
trace callbacks (`torch._C._activate_gpu_trace`) also see every sync, but cannot be turned off
again, and from then on every allocation and event record calls into Python.
"""

from __future__ import annotations

import dis
import linecache
import sys
import threading
import warnings
from dataclasses import dataclass, field
from time import perf_counter_ns
from types import CodeType, FrameType
from typing import TYPE_CHECKING, Any, cast

from torchtop.agent.hooks.frames import Kind
from torchtop.agent.warn import ignore_warning
from torchtop.contract.wire import SyncSite

if TYPE_CHECKING:
    from torchtop.agent.hooks.frames import Classifier
    from torchtop.agent.hooks.probe import Probe

MESSAGE = "called a synchronizing CUDA operation"
PROTOTYPE_MESSAGE = "Synchronization debug mode is a prototype feature"
WARN_MODE = 1  # torch.cuda.set_sync_debug_mode("warn")
MAX_SITES = 64
_WARNINGS_MODULES = ("warnings", "_py_warnings")


@dataclass
class Site:
    """One synchronising call: its place and what the windows counted there."""

    code: CodeType
    lasti: int
    lineno: int
    user: str  # "path:line qualname" of the user's frame
    via: str = ""  # the torch function that synchronised, when not the user's own call
    user_code: CodeType | None = None
    user_lasti: int = -1
    calls: int = 0
    steps: int = 0
    described: dict[str, str] = field(default_factory=dict)


def call_name(code: CodeType, lasti: int) -> str:
    """The call at instruction `lasti` of `code` as written in the source: "loss.item()",
    "print()", "x[mask]" (from the instruction's source position); "" when it cannot tell."""
    if sys.version_info < (3, 11):  # instructions have no source positions before 3.11
        return ""
    try:  # a frame in a Python call stands past the CALL, on its inline caches: the last one before
        op = [i for i in dis.get_instructions(code) if i.offset <= lasti][-1]
        pos = op.positions
    except Exception:  # broad: code that cannot be disassembled: no name
        return ""
    if pos is None or pos.lineno is None or pos.lineno != pos.end_lineno or pos.col_offset is None:
        return ""
    text = linecache.getline(code.co_filename, pos.lineno)[pos.col_offset : pos.end_col_offset]
    if not text:
        return ""
    if op.opname.startswith("CALL"):
        depth = 0
        for k, ch in enumerate(text):  # the callee: the text before the call's own "("
            depth += ch in "[{"
            depth -= ch in "]}"
            if ch == "(" and depth == 0:
                text = text[:k] + "()"
                break
    return text if len(text) <= 60 else text[:57] + "..."


class SyncWindow:
    """Opened and closed by the agent thread; its warning hook runs on the training thread."""

    def __init__(self, torch: Any, probe: Probe, classifier: Classifier, keys: dict) -> None:
        self.torch = torch
        self.probe = probe
        self.classifier = classifier
        self.keys = keys  # (id(code), offset) -> 1: shared with the stack sampler
        self.sites: dict[tuple[int, int], Site] = {}
        self.is_open = False
        self.windows = 0
        self.seen = 0  # synchronisations seen in all windows
        self.cost_ns = 0  # training-thread time in `_showwarning`
        self.reason = ""
        self._prev: Any = None
        self._hook = self._showwarning  # one bound method: `is` tells whether it is still installed
        self._filter: Any = None
        self._steps0 = 0

    def unavailable(self) -> str:
        """Why no window can open here ("" when one can)."""
        if getattr(sys.flags, "context_aware_warnings", 0):
            return (
                "this Python keeps warning filters per context: a window could not see the training thread's"
            )
        try:
            mode = self.torch.cuda.get_sync_debug_mode()
        except Exception as exc:  # broad: any failure is why sync windows are off
            return f"torch.cuda.get_sync_debug_mode() failed ({type(exc).__name__})"
        if mode != 0 and not self.is_open:
            return "the run set torch.cuda.set_sync_debug_mode() itself: left alone"
        return ""

    # -- agent thread --------------------------------------------------------------------------
    def open(self) -> bool:
        """Start a window (False, with `reason`, when one cannot open)."""
        if self.is_open:
            return True
        self.reason = self.unavailable()
        if self.reason:
            return False
        warnings.filterwarnings("always", message=MESSAGE, category=UserWarning)
        self._filter = warnings.filters[0]
        self._prev = warnings.showwarning
        warnings.showwarning = self._hook
        self._steps0 = self.probe.steps
        self.is_open = True
        try:
            self._set_mode(WARN_MODE)
        except Exception as exc:  # broad: any failure closes the window and says why
            self.reason = f"torch.cuda.set_sync_debug_mode() failed ({type(exc).__name__})"
            self.close()
            return False
        return True

    def _set_mode(self, mode: int) -> None:
        # torch says once that the mode is "a prototype feature": of our call, not the user's
        unignore = ignore_warning(PROTOTYPE_MESSAGE)
        try:
            self.torch.cuda.set_sync_debug_mode(mode)
        finally:
            unignore()

    def close(self) -> None:
        """End the window: torch's mode back to default (unless the run changed it meanwhile),
        the filter and the warning hook out (unless someone replaced the hook since)."""
        if not self.is_open:
            return
        try:
            if self.torch.cuda.get_sync_debug_mode() == WARN_MODE:
                self._set_mode(0)
        except Exception:  # broad: best-effort: the debug mode back off
            pass
        self.is_open = False
        if warnings.showwarning is self._hook:
            warnings.showwarning = self._prev
        try:
            cast("list[Any]", warnings.filters).remove(self._filter)  # a list; typeshed says Sequence
            mutated = getattr(warnings, "_filters_mutated", None)
            if mutated is not None:
                mutated()
        except ValueError:
            pass
        steps = max(0, self.probe.steps - self._steps0)
        for s in self.sites.values():
            if s.calls or s.steps:
                s.steps += steps
        self.windows += 1

    def described(self) -> list[SyncSite]:
        """The sites seen so far, most calls first, with their call and source line read off the
        code (here, on the agent thread, once a site)."""
        out = []
        for s in sorted(list(self.sites.values()), key=lambda s: -s.calls)[:16]:
            d = s.described
            if not d:
                code, lasti = (s.user_code, s.user_lasti) if s.user_code is not None else (s.code, s.lasti)
                path, _, rest = s.user.rpartition(":")
                lineno = int(rest.split(" ", 1)[0]) if rest.split(" ", 1)[0].isdigit() else 0
                d["call"] = call_name(code, lasti)
                d["line"] = linecache.getline(path, lineno).strip()[:200] if path and lineno else ""
            out.append(SyncSite(s.user, d["call"], s.via, d["line"], s.calls, s.steps))
        return out

    # -- training thread, inside a window ------------------------------------------------------
    def _showwarning(
        self, message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None
    ) -> None:
        if not (self.is_open and str(message).startswith(MESSAGE)):
            prev = self._prev if self._prev is not None else warnings._showwarning_orig  # type: ignore[attr-defined]
            prev(message, category, filename, lineno, file, line)
            return
        if threading.get_ident() != self.probe.tid:
            return  # another thread's: not the training loop's wait
        t = perf_counter_ns()
        try:
            self._seen(sys._getframe(1))
        except Exception:  # broad: a warning hook never raises into the user's code
            pass
        self.seen += 1
        self.cost_ns += perf_counter_ns() - t

    def _seen(self, frame: FrameType | None) -> None:
        while frame is not None and frame.f_globals.get("__name__") in _WARNINGS_MODULES:
            frame = frame.f_back
        if frame is None:
            return
        key = (id(frame.f_code), frame.f_lasti)  # the Site keeps the code alive: its id stays its own
        s = self.sites.get(key)
        if s is None:
            if len(self.sites) >= MAX_SITES:
                return
            s = self.sites[key] = self._site(frame)
            self.keys[key] = 1
        s.calls += 1

    def _site(self, frame: FrameType) -> Site:
        """The call's place; the user's frame that led to it (walked out once a site). A frame
        of torchtop's (the h2d wrapper around a pageable `.to()`) is looked through."""
        from torchtop.agent.hooks.frames import site

        kind_of = self.classifier.kind
        inner: FrameType | None = frame
        while inner is not None and kind_of(inner.f_code)[1] is Kind.OURS:
            inner = inner.f_back
        user = inner
        while user is not None and kind_of(user.f_code)[1] is not Kind.USER:
            user = user.f_back
        via = "" if inner is None or inner is user else self.classifier.callee(inner)
        at = user or inner or frame
        return Site(frame.f_code, frame.f_lasti, frame.f_lineno, site(at), via, at.f_code, at.f_lasti)
