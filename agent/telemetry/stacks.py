"""The training thread's Python stack, sampled from a thread of torchtop's: where host time goes.

A daemon thread wakes at a jittered rate (up to 20 Hz, fewer where a sample costs more than
BUDGET allows; a fixed period would alias with a periodic loop), reads the training thread's
innermost frame from `sys._current_frames()` and walks it outward (a few tens of microseconds,
holding the GIL: docs/benchmarks.md; nothing on the training thread). Each sample says which phase the thread was in, read off torchtop's own wrapper frames
on the stack (wrap.WRAPPER_PHASES: right on untimed steps too) or, where no wrapper is on it,
the probe's log (an explicit `phase()`, whose body has no frame of ours); the innermost frame of
the user's own code; what that frame was calling; and whether the innermost frame sat at a call
a sync window saw synchronise the device (sync_window.py).

The user's frame is the innermost of the user's own files (not torch's, a package's, the stdlib's,
nor code torch generated: frames.Kind), below a framework's frames where it calls back into them.
What it calls looks through wrappers (frames.WRAPS: torch.optim's, dynamo's, nn.Module's call);
below a framework's loop, the function our phase wrapper runs (the model's forward). A compiled
function's frame is named "(compiled)", calling the op at the generated graph's line.

The sample is taken when this thread gets the GIL. If the training thread held it (Python
code), that is up to the switch interval (5 ms) after the sample was due, and the stack is read
where the training thread let go of it: such a sample is marked `late` and never counts as a
wait on the device. Nothing is sampled while no monitor listens.
"""

from __future__ import annotations

import linecache
import os
import random
import re
import sys
import threading
import time
from collections import deque
from types import CodeType, FrameType
from typing import TYPE_CHECKING, Any

from torchtop.agent.hooks.frames import COMPILED_FN, WRAPS, Classifier, Kind, site
from torchtop.agent.telemetry.bytecode import call_names, input_offsets
from torchtop.contract.logcodes import (
    BACKWARD,
    COMM,
    FORWARD,
    FORWARD_START,
    GRAD,
    H2D_COPY,
    MARK,
    OPTIMIZER,
    SAMPLE_CHECKPOINT,
    SAMPLE_OTHER,
    SAVE,
)
from torchtop.contract.why import StackSample, function_of

if TYPE_CHECKING:
    from torchtop.agent.hooks.probe import Probe

OTHER = SAMPLE_OTHER  # a sample's phase outside the timed ones (logcodes.SAMPLE_PHASES)
DEFAULT_HZ = 20.0
LATE_NS = 500_000  # a sample this far past its time waited for the GIL: the stack moved on
MAX_DEPTH = 256
NEW_CAP = 4_000  # samples waiting for the next batch (a monitor that stopped reading loses the oldest)
RECENT_S = 10.0  # samples kept for a monitor that joins (its catch-up)
QUIET_CHECK_S = 0.5  # nobody listens: how often the thread looks again
# the sampler's CPU (most of it holding the GIL the training thread needs) stays under this share of
# wall time: at ~15 us a sample that allows the full rate; a loaded machine's dearer samples, fewer
BUDGET = 0.0005
MIN_HZ = 2.0
FIRST_SAMPLES = 5
OUTLIER = 4.0  # a sample dearer than this many times the smoothed cost counts as this much
CO_GENERATOR = 0x20  # inspect.CO_GENERATOR
LOOP_CAP = 16  # code objects of the frames that call the model (the training loop), kept
CALL_NAMES_CAP = 2_000  # code objects whose calls are named (a dict of offsets each): cleared past this
COMPILED = " (compiled)"  # a site's suffix: the frame runs a graph torch.compile made of it
GRAPH_CALL = re.compile(r"\s*(?:[\w, ]+=\s*)?([\w.]+)\(")  # "buf0 = empty_strided_cpu(...)": its callable


def _code_phase(c: Any) -> int | None:
    """The phase a log code leaves open (None: look further back)."""
    if type(c) is not int:
        if type(c) is not tuple or not c or c[0] in (MARK, H2D_COPY):
            return None  # a mark or a copy's record says nothing of the open phase
        c = c[0]
    if c < GRAD:
        return c
    if c == GRAD:
        return BACKWARD
    if c == SAVE:
        return SAMPLE_CHECKPOINT
    if c >= FORWARD_START:
        return FORWARD
    return OTHER  # a phase closed (its outer one is not tracked here), a step ended, a marker


def log_phase(probe: Probe) -> int:
    """The phase the probe's log leaves open: its last code items (or, the log just drained,
    the last ones the agent thread took). For an explicit `phase()`, which has no frame."""
    log = probe.log
    try:
        last = (len(log) & ~1) - 1  # the last whole pair's code item
        for i in range(last, max(0, last - 16), -2):
            got = _code_phase(log[i])
            if got is not None:
                return got
        if last > 0:
            return OTHER
    except IndexError:  # drained meanwhile
        pass
    tail = probe.tail
    for i in range(len(tail) - 1, 0, -2):
        got = _code_phase(tail[i])
        if got is not None:
            return got
    return OTHER


def explicit_syncs(torch: Any) -> dict[int, CodeType]:
    """The code of torch's explicit waits on the device (torch.cuda.synchronize, Event.synchronize,
    Stream.synchronize): a sample whose innermost frame is one of them is blocked on the GPU. They
    never warn under the sync debug mode, so no sync window finds them."""
    out: dict[int, CodeType] = {}
    try:
        cuda = torch.cuda
        fns = (cuda.synchronize, cuda.Event.synchronize, cuda.Stream.synchronize)
    except AttributeError:
        return out
    for fn in fns:
        code = getattr(fn, "__code__", None)
        if isinstance(code, CodeType):
            out[id(code)] = code
    return out


class StackSampler:
    """Samples `probe`'s training thread at about `hz` while `attended`; `take()` hands over
    the samples since the last call. `sync_keys` holds (id of the code, instruction offset) of calls seen
    synchronising the device (filled by SyncWindow); `sync_codes`, torch's explicit waits."""

    def __init__(self, probe: Probe, classifier: Classifier, hz: float = DEFAULT_HZ) -> None:
        self.probe = probe
        self.classifier = classifier
        self.hz = max(0.0, hz)  # the most samples a second
        self.rate = self.hz  # the rate now, under the budget
        self.sync_keys: dict[tuple[int, int], int] = {}  # (id(code), offset): SyncWindow keeps the code
        self.sync_codes: dict[int, CodeType] = {}  # id: code of the explicit waits (explicit_syncs)
        self.attended = False
        # the user's frames that call the model (outside a forward or backward wrapper, or as
        # the probe recorded at the first root forward): id(code) -> (code, its FOR_ITER
        # and next() call offsets). A generator such a frame resumes there is the loop's input
        # (`StackSample.input`)
        self.loop_codes: dict[int, tuple[CodeType, frozenset[int]]] = {}
        self.busy_ns = 0  # this thread's CPU time at work
        self.samples = 0
        self._calls: dict[int, tuple[CodeType, dict[int, str]]] = {}  # id(code): its named calls
        self._graph_calls: dict[tuple[str, int], str] = {}  # (generated file, line): its call
        self._new: deque[StackSample] = deque(maxlen=NEW_CAP)
        self._recent: deque[StackSample] = deque(maxlen=max(1, int(RECENT_S * max(self.hz, 1.0))))
        self._rand = random.Random()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def cost_us(self) -> float | None:
        """CPU per sample so far, at work (mostly holding the GIL)."""
        return self.busy_ns / self.samples / 1e3 if self.samples else None

    # -- one sample ----------------------------------------------------------------------------
    def sample(self, late: bool = False, now_ns: int | None = None) -> StackSample | None:
        """The training thread's stack now, or None (no such thread, or it is switched off)."""
        probe = self.probe
        tid = probe.tid
        frame = sys._current_frames().get(tid) if tid else None
        if frame is None:
            return None
        t = now_ns if now_ns is not None else time.perf_counter_ns()
        sync = not late and (
            (id(frame.f_code), frame.f_lasti) in self.sync_keys or id(frame.f_code) in self.sync_codes
        )
        kind_of = self.classifier.kind
        cached = self.classifier._cache.get  # the lookup inlined: a call less per frame
        if not self.loop_codes and probe.callers:
            self._loop_code(probe.callers)
        phase = -1
        user: FrameType | None = None
        lib: FrameType | None = None
        caller: FrameType | None = None
        user_fn = ""
        # prev: the last frame walked that is neither ours nor a wrapper of others' (the callee
        # named); entry: what our innermost phase wrapper runs, while no user frame is inside it
        # (a framework's loop calling the model: the model is named)
        user_callee = lib_callee = prev = entry = generated = None
        compiled = False
        loop_codes = self.loop_codes
        feeding = False  # the loop's input generator is on the stack, resumed by the loop
        comm = ""  # the collective wrapper of ours on the stack, innermost: its collective's name
        depth = 0
        f: FrameType | None = frame
        while f is not None and depth < MAX_DEPTH:
            code = f.f_code
            got = cached(id(code))
            if got is None or got[0] is not code:
                got = kind_of(code)
            _, kind, ph = got
            if ph >= 0 and phase < 0:
                phase = ph  # the innermost wrapper: a nested phase pauses its outer one
                if user is None:
                    entry = prev
                if ph == OPTIMIZER and (user or lib) and prev and kind_of(prev.f_code)[1] is Kind.TORCH:
                    phase, entry = OTHER, None  # torch's step runs others' code only as its closure
            if ph == COMM and user is None:
                comm = code.co_name  # the outermost collective wrapper: all_reduce, not its wait()
                if ph in (FORWARD, BACKWARD):
                    self._loop_frame(f)
            if kind is Kind.USER:
                if user is None:
                    user, user_callee = f, prev
                    user_fn = function_of(getattr(code, "co_qualname", code.co_name))
                    compiled = ph == COMPILED_FN
                elif caller is None and getattr(code, "co_qualname", code.co_name) != user_fn:
                    caller = f
                if code.co_flags & CO_GENERATOR and phase < 0:
                    back = f.f_back
                    loop = loop_codes.get(id(back.f_code)) if back is not None else None
                    if back is not None and loop is not None and loop[0] is back.f_code:  # narrows back
                        if back.f_lasti in loop[1]:
                            feeding = True
            elif kind is Kind.LIB and lib is None and user is None and ph != WRAPS:
                lib, lib_callee = f, prev
            elif kind is Kind.COMPILED and generated is None and user is None:
                generated = f  # inductor's code: where in the graph (its line's call)
            if user is not None and phase >= 0 and caller is not None:
                break
            if kind is not Kind.OURS and ph != WRAPS:
                prev = f
            f = f.f_back
            depth += 1
        if phase < 0:
            phase = OPTIMIZER if probe.opt_depth else log_phase(probe)
        at, callee = (user, user_callee) if user is not None else (lib, lib_callee)
        if entry is not None and user_callee is not None and kind_of(user_callee.f_code)[1] is Kind.LIB:
            callee = entry  # Trainer.train -> ... -> the model's forward: the model is named
        if comm and user is not None:
            called = f"torch.distributed:{comm}"  # the collective, not torch's logging decorator
        elif compiled and generated is not None:
            called = self._graph_call(generated)  # the graph's call at its line: a kernel, an extern op
        elif callee is not None:
            called = self.classifier.callee(callee)
            if kind_of(callee.f_code)[2] == COMPILED_FN:  # a model of torch's or a package's, compiled
                if ".<locals>." in called and generated is not None:  # torch's closure (wrap_inline)
                    called = self._graph_call(generated) or called
                called += COMPILED
        else:  # the site is the innermost Python frame: a C function it calls, named as called
            called = self._called(at) if at is not None else ""
        return StackSample(
            t,
            phase,
            (site(at) + COMPILED if compiled else site(at)) if at is not None else "",
            called,
            sync,
            late,
            site(caller) if caller is not None else "",
            feeding and phase == OTHER,
        )

    def _graph_call(self, frame: FrameType) -> str:
        """The function a line of torch's generated code calls ("extern_kernels.addmm",
        "cpp_fused_relu_0"), read off its source line: a graph's code is long, its bytecode dear."""
        key = (frame.f_code.co_filename, frame.f_lineno)
        got = self._graph_calls.get(key)
        if got is None:
            if len(self._graph_calls) > CALL_NAMES_CAP:
                self._graph_calls.clear()
            m = GRAPH_CALL.match(linecache.getline(*key))
            got = self._graph_calls[key] = m.group(1) if m else ""
        return got

    def _called(self, frame: FrameType) -> str:
        """The name the innermost frame calls at its instruction ("" where it is not a call)."""
        code = frame.f_code
        got = self._calls.get(id(code))
        if got is None or got[0] is not code:
            if len(self._calls) > CALL_NAMES_CAP:
                self._calls.clear()
            try:
                got = (code, call_names(code))
            except Exception:  # broad: dis over any code object: unnamed rather than no sample
                got = (code, {})
            self._calls[id(code)] = got
        return got[1].get(frame.f_lasti, "")

    def _loop_code(self, codes: tuple[CodeType, ...]) -> None:
        """The user's own code among `codes` (the frames that called the model, innermost first):
        the training loop is one of them (`for b in gen(): train_step(model, b)`)."""
        for code in codes:
            self._add_loop(code)
        if not self.loop_codes:
            self.loop_codes[0] = (codes[0], frozenset())  # none of the user's: do not look again

    def _add_loop(self, code: CodeType) -> None:
        if len(self.loop_codes) < LOOP_CAP and id(code) not in self.loop_codes:
            if self.classifier.kind(code)[1] is Kind.USER:
                self.loop_codes[id(code)] = (code, input_offsets(code))

    def _loop_frame(self, wrapper: FrameType) -> None:
        """Remember the user's frames that called the model (outside the forward or backward
        wrapper `wrapper`): the training loop is one of them."""
        if len(self.loop_codes) >= LOOP_CAP:
            return
        f, depth = wrapper.f_back, 0
        while f is not None and depth < 32:
            self._add_loop(f.f_code)
            f, depth = f.f_back, depth + 1

    # -- the thread ----------------------------------------------------------------------------
    def start(self) -> None:
        if self.hz <= 0:
            return
        self._thread = threading.Thread(target=self._run, name="torchtop-stacks", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(2.0)

    def _run(self) -> None:
        # a sample's CPU time, smoothed, past the first few (a first sighting of many code objects
        # is dearer once): the rate backs off where samples cost more
        cost_ns = 15_000.0
        due = time.monotonic() + 1.0 / self.hz
        while not self._stop.wait(max(0.0, due - time.monotonic())):
            if not self.attended:
                due = time.monotonic() + QUIET_CHECK_S
                continue
            busy = time.thread_time_ns()
            now = time.perf_counter_ns()
            late = (time.monotonic() - due) * 1e9 > LATE_NS
            try:
                got = self.sample(late, now)
            except Exception:  # broad: the sampler thread outlives any sample's failure
                got = None
            if got is not None:
                self._new.append(got)
                self._recent.append(got)
                self.samples += 1
            spent = time.thread_time_ns() - busy
            self.busy_ns += spent
            if self.samples > FIRST_SAMPLES:
                # one dear sample (new code classified: file-system lookups; a page fault) is a
                # one-off, not what the next ones cost: it moves the smoothed cost 4x at most
                cost_ns = 0.9 * cost_ns + 0.1 * min(spent, OUTLIER * cost_ns)
            self.rate = min(self.hz, max(MIN_HZ, BUDGET / (cost_ns / 1e9)))
            due += (0.5 + self._rand.random()) / self.rate  # jittered: no aliasing with a periodic loop
            due = max(due, time.monotonic())

    def take(self, catch_up: bool = False) -> list[StackSample]:
        """The samples since the last call (a joining monitor: the last RECENT_S seconds')."""
        if catch_up:
            self._new.clear()
            return list(self._recent)
        out = []
        pop = self._new.popleft
        try:
            while True:
                out.append(pop())
        except IndexError:
            return out


def sampler_rate() -> float:
    """TORCHTOP_STACK_HZ (0: off), else DEFAULT_HZ."""
    try:
        return max(0.0, min(200.0, float(os.environ.get("TORCHTOP_STACK_HZ", DEFAULT_HZ))))
    except ValueError:
        return DEFAULT_HZ
