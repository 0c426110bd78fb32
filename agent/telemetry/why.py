"""What says why, run from the agent thread: the stack sampler, sync windows, the FLOP count.

`tick()` runs in the agent loop's tick (the thread that also arms captures): it opens and closes
sync windows on a schedule, and arms the one-step FLOP count once the run is past its first steps
as a step-boundary hook of the probe (hooks/step_hooks.py: it waits while a capture holds the
step, and an armed count gives way to a capture). `message()` is the `wire.Why` each batch
carries. Every figure's cost and meaning: docs/why.md.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from torchtop.agent.hooks.frames import classifier_for
from torchtop.agent.hooks.step_hooks import Claim, Order
from torchtop.agent.telemetry.stacks import StackSampler, explicit_syncs, sampler_rate
from torchtop.agent.warn import notice
from torchtop.contract.wire import FlopInfo, SyncInfo, Why

if TYPE_CHECKING:
    from torchtop.agent.cuda_use import CudaUse
    from torchtop.agent.hooks.auto import AutoHooks
    from torchtop.agent.hooks.flop_step import FlopResult, FlopStep
    from torchtop.agent.hooks.probe import Probe
    from torchtop.agent.hooks.sync_window import SyncWindow

WINDOW_S = 2.0  # a sync window lasts this long ...
WINDOW_MIN_STEPS = 3  # ... and at least this many steps (slow steps) ...
WINDOW_MAX_S = 10.0  # ... but never longer than this
FIRST_WINDOW_AFTER_STEPS = 12  # the first window opens past warm-up, whoever listens
WINDOW_EVERY_S = 60.0  # then one a minute while a monitor listens (new code paths: eval, logging)
FLOP_STEP = 12  # the FLOPs are counted over the step after this many steps (past warm-up)
FLOP_GIVE_UP_S = 60.0  # armed and no boundary came: give up


def _env_float(name: str) -> float | None:
    try:
        value = float(os.environ[name])
    except (KeyError, ValueError):
        return None
    return value if value > 0 else None


class WhyCollector:
    def __init__(
        self,
        torch: Any,
        probe: Probe,
        cuda: CudaUse | None,
        hooks: AutoHooks | None,
        peak_tflops: float | None = None,
        flops_per_step: float | None = None,
    ) -> None:
        self.torch = torch
        self.probe = probe
        self.cuda = cuda
        self.hooks = hooks
        self.classifier = classifier_for(torch)
        self.sampler = StackSampler(probe, self.classifier, sampler_rate())
        self.sampler.sync_codes = explicit_syncs(torch)
        self.busy_ns = 0  # this (agent) thread's time in tick(): windows, arming
        self.sync_on = os.environ.get("TORCHTOP_SYNC_CHECK", "1") != "0"
        self.window: SyncWindow | None = None
        self._window_until = 0.0
        self._window_steps = 0
        self._next_window = 0.0
        self._announced = False
        self.sync_state = "waiting" if self.sync_on else "off"
        self.sync_reason = "" if self.sync_on else "TORCHTOP_SYNC_CHECK=0"
        self.last_window_at: float | None = None
        peak = peak_tflops or _env_float("TORCHTOP_PEAK_TFLOPS")
        given = flops_per_step or _env_float("TORCHTOP_FLOPS_PER_STEP")
        self.flops = FlopInfo(state="waiting", peak_tflops=peak)
        if given:
            self.flops = FlopInfo(state="done", source="given", flops=int(given), peak_tflops=peak)
        elif os.environ.get("TORCHTOP_FLOPS", "1") == "0":
            self.flops = FlopInfo(state="off", reason="TORCHTOP_FLOPS=0", peak_tflops=peak)
        self._flop_armed_at = 0.0
        self._flop_step: FlopStep | None = None
        self._flop_step_announced = False
        self.params: int | None = None  # the roots' parameters, counted when the roots change
        self._params_of: tuple[int, ...] = ()

    def start(self) -> None:
        self.sampler.start()

    def stop(self) -> None:
        if self._flop_step is not None:
            self._flop_step.finish_here()
        self.sampler.stop()
        if self.window is not None:
            try:
                self.window.close()
            except Exception:  # broad: best-effort cleanup
                pass

    # -- agent thread ------------------------------------------------------------------------------
    def tick(self, attended: bool) -> None:
        busy = time.thread_time_ns()
        self.sampler.attended = attended
        try:
            self._sync_tick(attended)
        except Exception as exc:  # broad: sync windows are optional: any failure turns them off, said
            self.sync_state, self.sync_reason = (
                "off",
                f"sync windows failed ({type(exc).__name__}: {exc})"[:200],
            )
        try:
            self._flop_tick()
        except Exception as exc:  # broad: the FLOP count is optional: any failure is its state
            self.flops = FlopInfo(state="failed", reason=f"{type(exc).__name__}: {exc}"[:200])
        try:
            self._params_tick()
        except Exception:  # broad: a module changed while read (the training thread runs): a later tick
            pass
        self.busy_ns += time.thread_time_ns() - busy

    def _params_tick(self) -> None:
        """The roots' parameters (shared ones once), counted here, off the training thread, when
        the roots are first known and again when they change: a pipeline stage's work, to the monitor."""
        roots = self.hooks.root_modules() if self.hooks is not None and self.probe.steps else []
        key = tuple(sorted(id(m) for m in roots))
        if not roots or key == self._params_of:
            return
        seen: set[int] = set()
        n = 0
        for m in roots:
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    n += int(p.numel())
        self.params, self._params_of = n, key

    def _cuda(self) -> bool:
        return self.cuda is not None and self.cuda.holds_memory()

    def _sync_tick(self, attended: bool) -> None:
        if not self.sync_on or self.sync_state == "off":
            return
        now = time.monotonic()
        w = self.window
        if w is not None and w.is_open:
            steps = self.probe.steps - self._window_steps
            if now >= self._window_until and (
                steps >= WINDOW_MIN_STEPS or now >= self._window_until + WINDOW_MAX_S
            ):
                w.close()
                self.sync_state, self.last_window_at = "idle", time.time()
                self._next_window = now + WINDOW_EVERY_S
            return
        if not self._cuda():
            self.sync_state = "waiting"
            self.sync_reason = (
                "CPU run: nothing to wait for (on CPU .item() and print(tensor) read values already "
                "computed); their host time shows in the stack samples"
            )
            return
        if self.sync_reason.startswith("CPU run"):
            self.sync_reason = ""
        if self.probe.steps < FIRST_WINDOW_AFTER_STEPS:
            return
        if (self.window is not None and not attended) or now < self._next_window:
            return
        if w is None:
            from torchtop.agent.hooks.sync_window import SyncWindow

            w = self.window = SyncWindow(self.torch, self.probe, self.classifier, self.sampler.sync_keys)
        if not w.open():  # the run set a sync debug mode of its own: ask again later
            self.sync_state, self.sync_reason = "waiting", w.reason
            self._next_window = now + WINDOW_EVERY_S
            return
        if not self._announced:
            self._announced = True
            notice(
                f"finding the calls that wait for the GPU: {WINDOW_S:g} s with "
                "torch.cuda.set_sync_debug_mode('warn') (its warnings are taken, not printed), "
                f"again every {WINDOW_EVERY_S:g} s while a monitor watches; TORCHTOP_SYNC_CHECK=0 turns it off"
            )
        self.sync_state, self.sync_reason = "window", ""
        self._window_until = now + WINDOW_S
        self._window_steps = self.probe.steps

    def _flop_tick(self) -> None:
        f = self.flops
        probe = self.probe
        if f.state == "counting":
            fs = self._flop_step
            if fs is not None and not fs.entered:
                if not fs.armed():  # a capture took the next boundary: count later
                    self.flops = FlopInfo(state="waiting", peak_tflops=f.peak_tflops)
                elif time.monotonic() - self._flop_armed_at > FLOP_GIVE_UP_S:
                    fs.disarm()
                    self.flops = FlopInfo(
                        state="failed", reason="no step boundary came", peak_tflops=f.peak_tflops
                    )
            return
        if f.state != "waiting" or probe.steps < FLOP_STEP or not probe.active:
            return
        if probe.hooks.claim(Order.FLOP_COUNT) is Claim.WAIT:  # a capture holds the step
            return
        roots = self.hooks.root_modules() if self.hooks is not None else []
        if any(type(m).__name__ == "OptimizedModule" or "_compiled_call_impl" in m.__dict__ for m in roots):
            self.flops = FlopInfo(
                state="off",
                reason="the model is compiled (FlopCounterMode would make dynamo recompile): "
                "set TORCHTOP_FLOPS_PER_STEP for MFU",
                peak_tflops=f.peak_tflops,
            )
            return
        from torchtop.agent.hooks.flop_step import FlopStep

        fs = FlopStep(self.torch, probe, lambda: roots, self._flops_done)
        if not fs.arm():  # a capture came meanwhile (this thread arms captures too: not expected)
            return
        self._flop_step = fs
        self._flop_armed_at = time.monotonic()
        self.flops = FlopInfo(state="counting", peak_tflops=f.peak_tflops)
        if self._flop_step_announced is False:
            self._flop_step_announced = True
            notice(
                "counting the model's FLOPs over one step with torch.utils.flop_counter (that step runs "
                "slower and is left out of the figures); TORCHTOP_FLOPS=0 turns it off"
            )

    def _flops_done(self, r: FlopResult) -> None:
        """On the training thread, at the boundary that ends the counted step."""
        peak = self.flops.peak_tflops
        if r.error:
            self.flops = FlopInfo(state="failed", reason=r.error, peak_tflops=peak)
            return
        tf32 = conv_tf32 = False
        try:
            tf32 = self.torch.get_float32_matmul_precision() != "highest"
            conv_tf32 = bool(self.torch.backends.cudnn.allow_tf32)  # True by default: convs run TF32
        except Exception:  # broad: a torch that cannot say: TF32 unknown
            pass
        from torchtop.agent.hooks.flop_step import CONV_FP32

        by_dtype = dict(r.by_dtype)
        conv = by_dtype.pop(CONV_FP32, 0)
        if conv:
            key = "tf32" if conv_tf32 else "float32"
            by_dtype[key] = by_dtype.get(key, 0) + conv
        self.flops = FlopInfo(
            state="done",
            source="counted",
            flops=r.flops,
            by_dtype=by_dtype,
            tf32=tf32,
            samples=r.samples or None,
            tokens=r.tokens or None,
            input_shape=r.input_shape,
            input_dtype=r.input_dtype,
            t0=r.t0,
            t1=r.t1,
            cost_ms=(r.t1 - r.t0) / 1e6 if r.t1 > r.t0 else None,
            peak_tflops=peak,
        )

    # -- the batch ---------------------------------------------------------------------------------
    def sync_info(self) -> SyncInfo:
        w = self.window
        sites = w.described() if w is not None else []
        cost = w.cost_ns / w.seen / 1e3 if w is not None and w.seen else None
        return SyncInfo(
            state=self.sync_state,
            reason=self.sync_reason,
            windows=w.windows if w is not None else 0,
            window_s=WINDOW_S,
            every_s=WINDOW_EVERY_S,
            last_at=self.last_window_at,
            cost_us=cost,
            sites=sites,
        )

    def message(self, catch_up: bool = False) -> Why:
        s = self.sampler
        return Why(
            stacks=s.take(catch_up),
            stack_hz=round(s.rate, 1) if s.hz else 0.0,
            stack_cost_us=s.cost_us,
            sync=self.sync_info(),
            flops=self.flops,
            params=self.params,
        )
