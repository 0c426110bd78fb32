"""The agent's lifecycle: start, stop, fork and exit handling.

`start()` returns at once and never raises: any problem (no torch, a port in use, an unwritable
runtime directory) is one line on stderr and training goes on, unobserved at worst. The agent
listens on private ipc:// sockets unless a port or bind address asks for TCP (sockets.py).
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from torchtop.agent import describe, identity, start_options
from torchtop.agent.start_options import StartOptions
from torchtop.agent.warn import announce, warn
from torchtop.contract import discovery, wire

if TYPE_CHECKING:
    from types import ModuleType

    from torchtop.agent.hooks.auto import AutoHooks
    from torchtop.agent.loop.recorder import Recorder
    from torchtop.agent.telemetry.collector import TelemetryCollector
    from torchtop.agent.telemetry.why import WhyCollector

IDENTITY_EVERY_S = 1.0  # the agent thread asks torch.distributed who this rank is this often
_lock = threading.Lock()
_agent: Agent | None = None


class Agent:
    """One running agent: probe + hooks on the training thread; sockets and loop on its own."""

    def __init__(self, torch: ModuleType, options: StartOptions) -> None:
        """`options` resolved (StartOptions.resolved): the environment's defaults read."""
        from torchtop.agent.cuda_use import CudaUse
        from torchtop.agent.hooks.auto import AutoHooks
        from torchtop.agent.hooks.probe import Probe
        from torchtop.agent.loop.loop import AgentLoop
        from torchtop.agent.loop.sockets import open_ipc, open_sockets, socket_dir

        self.torch = torch
        self.pid = os.getpid()
        self.run_id = uuid.uuid4().hex[:12]
        self.start_time = time.time()
        self.identity = identity.from_env()
        self._identity_due = 0.0
        from torchtop.agent.loop.relay_start import RelayStarter

        self.relay = RelayStarter()  # local rank 0 starts its node's relay (docs/multi-rank.md)
        if options.port is None and options.bind is None:  # the default: Unix sockets only this user can open
            self.sockets = open_ipc(socket_dir(), self.pid)  # BindError propagates to start()
        else:  # TCP when asked for: always CURVE
            self.sockets = open_sockets(options.bind or "127.0.0.1", options.port)
        self.probe = Probe()
        self.probe.phase_every = max(0, options.phase_every or 0)
        self.hooks: AutoHooks | None = None
        self.telemetry: TelemetryCollector | None = None
        self.recorder: Recorder | None = None
        self.why: WhyCollector | None = None
        try:
            from torchtop.agent.capture.controller import CaptureController

            self.cuda = CudaUse(torch)
            self.captures = CaptureController(self.cuda, self.probe)
            self.captures.rank = self.identity.rank if self.identity.world_size > 1 else None
            from torchtop.agent.telemetry.collector import TelemetryCollector

            self.telemetry = TelemetryCollector(self.cuda)
            self.telemetry.user_limit = int(options.memory_limit or 0)
            self.telemetry.train_thread = lambda: self.probe.tid  # its CPU wait: a host's oversubscription
            if options.oom_snapshot_at:
                from torchtop.agent.capture.oom_snapshot import OomSnapshot

                self.telemetry.oom = OomSnapshot(float(options.oom_snapshot_at), self.captures.request)
            from torchtop.agent.telemetry import flight

            if flight.enable():  # before the user's process groups: the buffer takes effect for those
                self.telemetry.flight = flight.FlightReader()
            # no launcher named the rank (mp.spawn): the recording waits for the process group's
            self.recorder = start_options.recorder(
                options.record, self.rank if self.identity.launcher else None
            )
            self.telemetry.recording = self.recorder is not None
            self.telemetry.start()
            if options.auto:
                self.hooks = AutoHooks(self.probe, torch, h2d=torch.cuda.is_available())
                self.hooks.install()
            from torchtop.agent.telemetry.why import WhyCollector

            self.why = WhyCollector(
                torch, self.probe, self.cuda, self.hooks, options.peak_tflops, options.flops_per_step
            )
            self.why.start()
            self.loop = AgentLoop(
                self.probe,
                self.sockets,
                self.hello,
                self.run_id,
                self.cuda,
                self.rank,
                telemetry=self.telemetry,
                captures=self.captures,
                chores=self._chores,
                why=self.why,
                recorder=self.recorder,
            )
            if self.recorder is not None:
                self.recorder.start()
            self.loop.start()
        except BaseException:  # broad: tears down what started on any exit, then re-raises
            self._teardown()
            raise
        self.discovery_file: Path | None = None
        # zero-code agents are listed once they see the model run: a launcher that only spawns
        # ranks (mp.spawn), a compile worker or any other helper that imports torch stays unlisted
        self.unpublished = options.publish_when_active
        if not options.publish_when_active:
            self._publish()

    def _publish(self) -> None:
        self.unpublished = False
        try:
            self.discovery_file = discovery.write(self.discovery_info())
        except OSError as exc:
            how = (
                f"attach with `torchtop attach {self.sockets.address}`"
                if self.sockets.transport == "ipc"
                else f"attach with `torchtop attach {self.sockets.address} --server-key KEY` once the agent "
                "uses keys of yours (TORCHTOP_CURVE=1, `torchtop keys --server`)"
            )
            warn(
                f"cannot write the discovery file ({exc}); `torchtop ls` will not list this run: "
                f"{how}, or set TORCHTOP_RUNTIME_DIR to a writable directory of yours"
            )

    @property
    def port(self) -> int:
        return self.sockets.port

    @property
    def rank(self) -> int:
        return self.identity.rank

    @property
    def world_size(self) -> int:
        return self.identity.world_size

    @property
    def local_rank(self) -> int:
        return self.identity.local_rank

    def _chores(self) -> None:
        """Agent thread, each tick: the hooks' chores; once a second, who this rank is."""
        if self.hooks is not None:
            self.hooks.agent_tick()
        self._settle_recording()
        if self.unpublished and (
            self.probe.steps > 0 or (self.hooks is not None and self.hooks.seen_model())
        ):
            identity.refresh_from_dist(self.identity, self.torch)  # listed with its rank, not 0
            self.loop.rank = self.loop.router.rank = self.identity.rank
            self.captures.rank = self.identity.rank if self.identity.world_size > 1 else None
            self._publish()
            announce(describe.where(self), self.rank)
        now = time.monotonic()
        if now < self._identity_due:
            return
        self._identity_due = now + IDENTITY_EVERY_S
        ident = self.identity
        self.relay.tick(ident)
        if identity.refresh_from_dist(ident, self.torch):
            self.loop.rank = self.loop.router.rank = ident.rank
            self.captures.rank = ident.rank if ident.world_size > 1 else None
            self._rewrite_discovery()
        dist = getattr(self.torch, "distributed", None)
        try:  # a process group of several ranks: timed backwards mark where their compute ends
            self.probe.comm = bool(
                self.probe.active and ident.world_size > 1 and dist is not None and dist.is_initialized()
            )
        except Exception:  # broad: a process group that cannot say is one rank; never into training
            self.probe.comm = False

    def _settle_recording(self) -> None:
        """Agent thread, each tick while the recording waits for this process's rank: the process
        group's once there is one, else 0 once the process trains or runs its model on its own."""
        rec = self.recorder
        if rec is None or rec.rank is not None:
            return
        ident = self.identity
        if identity.refresh_from_dist(ident, self.torch):
            self.loop.rank = self.loop.router.rank = ident.rank
            self.captures.rank = ident.rank if ident.world_size > 1 else None
            self._rewrite_discovery()
        try:  # a Hello that cannot be built now: asked again next tick; the chores after it go on
            if ident.backend or self.probe.steps > 0 or (self.hooks is not None and self.hooks.seen_model()):
                rec.settle(ident.rank, self.hello())
        except Exception:  # broad: never ends the agent thread's chores
            pass

    def _rewrite_discovery(self) -> None:
        if getattr(self, "discovery_file", None) is None:
            return
        try:
            self.discovery_file = discovery.write(self.discovery_info())
        except OSError:
            pass  # said once at start; the file keeps the launcher's identity

    def device(self) -> tuple[str, str]:
        """("cuda"|"cpu", device name) judged from the model's parameters, else CUDA's state."""
        return describe.device(self)

    def hello(self) -> wire.Hello:
        return describe.hello(self)

    def discovery_info(self) -> discovery.AgentInfo:
        """What the discovery file holds (0600): how local monitors of this user find and reach us."""
        return describe.discovery_info(self)

    def _teardown(self) -> None:
        self.probe.disable()
        if self.why is not None:
            self.why.stop()
        if self.telemetry is not None:
            self.telemetry.stop()
        if self.recorder is not None:
            self.recorder.close()
        if self.hooks is not None:
            self.hooks.uninstall()
        self.sockets.close()

    def stop(self) -> None:
        self.probe.disable()  # disarms a capture too: no boundary reaches it any more
        if self.hooks is not None:
            self.hooks.uninstall()
        loop = getattr(self, "loop", None)
        if self.recorder is not None and self.telemetry is not None:
            try:  # the recording ends with the host as it is now (unattended it is read every 10 s)
                self.telemetry.slow(host_only=True)
            except Exception:  # broad: best-effort last host sample at stop
                pass
        if loop is not None:
            loop.stop()
        if self.recorder is not None and self.recorder.rank is None and not self.unpublished:
            try:  # started by hand and never trained: recorded as rank 0 (a zero-code helper is not)
                identity.refresh_from_dist(self.identity, self.torch)
                self.recorder.settle(self.rank, self.hello())
            except Exception:  # broad: a hello that cannot be built at exit: nothing recorded
                pass
        if getattr(self, "captures", None) is not None:
            self.captures.close()  # after the agent thread, which owned the capture's record
        if self.recorder is not None:  # after the loop's last tick: its batch is recorded too
            self.recorder.close()
        if self.why is not None:
            self.why.stop()
        if self.telemetry is not None:
            self.telemetry.stop()
        self.sockets.close()
        if os.getpid() == self.pid:
            discovery.remove(self.pid)

    def abandon_after_fork(self) -> None:
        """In a forked child: restore the patches, touch no socket or thread of the parent."""
        self.probe.disable()
        if self.hooks is not None:
            self.hooks.uninstall()


def start(
    port: int | None = None,
    bind: str | None = None,
    auto: bool = True,
    phase_every: int | None = None,
    record: str | os.PathLike[str] | None = None,
    peak_tflops: float | None = None,
    flops_per_step: float | None = None,
    publish_when_active: bool = False,
    memory_limit: int | str | None = None,
    oom_snapshot_at: float | None = None,
) -> Agent | None:
    """Start the agent in this process (once). Returns at once; never raises into training.

    port: listen on TCP, on this request port (batches go out on port + 1; 0: a free pair);
    default $TORCHTOP_PORT. bind: listen on TCP at this address (default $TORCHTOP_BIND, then
    127.0.0.1 when a port is given). With neither, the agent listens on ipc:// sockets in the
    private runtime directory, which no other user can open. TCP is always CURVE-encrypted.
    auto: install the zero-code hooks.
    phase_every: time the phases of every step (1), of about 1 step in N (N), or by step time
    (0, the default, or $TORCHTOP_PHASE_EVERY): every step of 10 ms or more, a random sample of
    faster ones. Every step's end and wall time is logged whatever this says.
    record: a directory to record the run into (rank r writes PATH/rank{r}), watched or not;
    default $TORCHTOP_RECORD (none). Its size is bounded by $TORCHTOP_RECORD_MB (1024 MiB a
    rank): older steps are thinned to one a tick, the oldest then deleted (docs/recording.md).
    peak_tflops: the device's peak TFLOP/s for MFU (default $TORCHTOP_PEAK_TFLOPS, else the
    monitor's table of common GPUs). flops_per_step: the model's FLOPs a step, when counting
    them over one step (FlopCounterMode) will not do (default $TORCHTOP_FLOPS_PER_STEP).
    publish_when_active: list the agent (`torchtop ls`) only once the process runs a model or
    counts a step (zero-code start: launchers and helpers that import torch stay unlisted).
    memory_limit: the memory this run may reach, bytes or "12GiB" (default $TORCHTOP_MEMORY_LIMIT):
    the time-to-limit forecast's ceiling where it is below the host's (cgroup, rlimit, the machine)
    or the device's. oom_snapshot_at: once memory passes this share of its limit (e.g. 0.9;
    default $TORCHTOP_OOM_SNAPSHOT_AT, none), one CUDA memory snapshot is taken and kept.
    Never in a DataLoader worker; in a multiprocessing child still being set up, the start waits
    until it is (agent/spawned.py) and is skipped there if the child is a loader worker.
    """
    options = StartOptions(
        port,
        bind,
        auto,
        phase_every,
        record,
        peak_tflops,
        flops_per_step,
        publish_when_active,
        memory_limit,
        oom_snapshot_at,
    )
    return _start(options)


def _start(options: StartOptions) -> Agent | None:
    global _agent
    try:
        with _lock:
            if _agent is not None:
                return _agent
            from torchtop.agent import spawned

            if spawned.loader_worker():
                return None  # a DataLoader worker only loads: the training process is watched
            if spawned.setting_up():  # its target is not known yet: start in _bootstrap, or not
                spawned.when_set_up(lambda: _start(options))
                return None
            try:
                import torch
            except Exception as exc:  # broad: a broken torch may raise anything at import
                warn(
                    f"torch is not importable ({exc}); install torch (pip install 'torchtop[torch]'); the agent is off"
                )
                return None
            from torchtop.agent.loop.sockets import BindError

            try:
                _agent = Agent(torch, options.resolved())
            except BindError as exc:
                warn(f"{exc}; training continues without torchtop")
                return None
            if not _agent.unpublished:  # else said when it is listed
                announce(describe.where(_agent), _agent.rank)
            return _agent
    except Exception as exc:  # broad: never into training
        warn(f"agent failed to start ({type(exc).__name__}: {exc}); training continues without it")
        _agent = None
        return None


def stop() -> None:
    """Stop the agent: every hook and patch removed, sockets closed, discovery file gone."""
    global _agent
    try:
        with _lock:
            agent, _agent = _agent, None
            if agent is not None:
                agent.stop()
    except Exception as exc:  # broad: stop never raises into the user's program
        warn(f"agent stop failed ({type(exc).__name__}: {exc})")


def current() -> Agent | None:
    return _agent


def _after_fork_in_child() -> None:
    global _agent, _lock
    _lock = threading.Lock()
    agent, _agent = _agent, None
    if agent is not None:
        try:
            agent.abandon_after_fork()
        except Exception:  # broad: the forked child runs whatever state the agent was in
            pass


atexit.register(stop)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
