"""The agent's lifecycle: start, stop, fork and exit handling.

`start()` returns at once and never raises: any problem (no torch, a port in use, an unwritable
runtime directory) is one line on stderr and training goes on, unobserved at worst.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import time
import uuid
from typing import Any

from torchtop.agent import identity
from torchtop.agent.contract import discovery, wire
from torchtop.agent.warn import warn

VERSION = "0.1.0"
IDENTITY_EVERY_S = 1.0  # the agent thread asks torch.distributed who this rank is this often
_lock = threading.Lock()
_agent: Agent | None = None


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


class Agent:
    """One running agent: probe + hooks on the training thread; sockets and loop on its own."""

    def __init__(self, torch: Any, port: int | None, bind: str, auto: bool, phase_every: int = 0) -> None:
        from torchtop.agent.cuda_use import CudaUse
        from torchtop.agent.hooks.auto import AutoHooks
        from torchtop.agent.hooks.probe import Probe
        from torchtop.agent.loop.loop import AgentLoop
        from torchtop.agent.loop.sockets import open_sockets

        self.torch = torch
        self.pid = os.getpid()
        self.run_id = uuid.uuid4().hex[:12]
        self.start_time = time.time()
        self.identity = identity.from_env()
        self._identity_due = 0.0
        self.sockets = open_sockets(bind, port)  # BindError propagates to start()
        self.probe = Probe()
        self.probe.phase_every = max(0, phase_every)
        self.hooks = None
        self.telemetry = None
        try:
            from torchtop.agent.capture.controller import CaptureController

            self.cuda = CudaUse(torch)
            self.captures = CaptureController(self.cuda, self.probe)
            self.captures.rank = self.identity.rank if self.identity.world_size > 1 else None
            from torchtop.agent.telemetry.collector import TelemetryCollector

            self.telemetry = TelemetryCollector(self.cuda)
            self.telemetry.start()
            if auto:
                self.hooks = AutoHooks(self.probe, torch, h2d=torch.cuda.is_available())
                self.hooks.install()
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
            )
            self.loop.start()
        except BaseException:
            self._teardown()
            raise
        self.discovery_file = None
        try:
            self.discovery_file = discovery.write(self._discovery_info())
        except OSError as exc:
            warn(
                f"cannot write the discovery file ({exc}); `torchtop ls` will not list this run: "
                f"attach with `torchtop attach 127.0.0.1:{self.port}` or set TORCHTOP_RUNTIME_DIR "
                "to a writable directory"
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
        now = time.monotonic()
        if now < self._identity_due:
            return
        self._identity_due = now + IDENTITY_EVERY_S
        ident = self.identity
        if identity.refresh_from_dist(ident, self.torch):
            self.loop.rank = self.loop.router.rank = ident.rank
            self.captures.rank = ident.rank if ident.world_size > 1 else None
            self._rewrite_discovery()
        dist = getattr(self.torch, "distributed", None)
        try:  # a process group of several ranks: timed backwards mark where their compute ends
            self.probe.comm = bool(
                self.probe.active and ident.world_size > 1 and dist is not None and dist.is_initialized()
            )
        except Exception:
            self.probe.comm = False

    def _rewrite_discovery(self) -> None:
        if getattr(self, "discovery_file", None) is None:
            return
        try:
            self.discovery_file = discovery.write(self._discovery_info())
        except OSError:
            pass  # said once at start; the file keeps the launcher's identity

    def device(self) -> tuple[str, str]:
        """("cuda"|"cpu", device name) judged from the model's parameters, else CUDA's state."""
        torch = self.torch
        for module in self.hooks.root_modules() if self.hooks else []:
            try:
                param = next(module.parameters())
            except (StopIteration, Exception):
                continue
            if param.device.type == "cuda":
                return "cuda", torch.cuda.get_device_name(param.device)
            return param.device.type, ""
        try:
            if torch.cuda.is_initialized():
                return "cuda", torch.cuda.get_device_name()
        except Exception:
            pass
        return "cpu", ""

    def hello(self) -> wire.Hello:
        device, name = self.device()
        return wire.Hello(
            v=wire.PROTOCOL_VERSION,
            run_id=self.run_id,
            pid=self.pid,
            host=socket.gethostname(),
            port=self.port,
            pub_port=self.sockets.pub_port,
            device=device,
            device_name=name,
            start_time=self.start_time,
            rank=self.rank,
            world_size=self.world_size,
            local_rank=self.local_rank,
            torch_version=str(getattr(self.torch, "__version__", "")),
            agent_version=VERSION,
            argv=list(sys.argv),
            cuda_event_every=self.probe.event_every if self.probe.pool is not None else 0,
            job_id=self.identity.job_id,
            launcher=self.identity.launcher,
            node_rank=self.identity.node_rank,
            local_world_size=self.identity.local_world_size,
            backend=self.identity.backend,
        )

    def _discovery_info(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "host": socket.gethostname(),
            "bind": self.sockets.bind,
            "port": self.port,
            "pub_port": self.sockets.pub_port,
            "rank": self.rank,
            "world_size": self.world_size,
            "local_rank": self.local_rank,
            "local_world_size": self.identity.local_world_size,
            "node_rank": self.identity.node_rank,
            "job_id": self.identity.job_id,
            "launcher": self.identity.launcher,
            "argv": list(sys.argv),
            "start_time": self.start_time,
            "run_id": self.run_id,
            "version": VERSION,
            # the agent's CURVE public key (not a secret) when CURVE is on: local monitors use it
            "server_key": self.sockets.curve.public.decode() if self.sockets.curve else None,
        }

    def _teardown(self) -> None:
        self.probe.disable()
        if self.telemetry is not None:
            self.telemetry.stop()
        if self.hooks is not None:
            self.hooks.uninstall()
        self.sockets.close()

    def stop(self) -> None:
        self.probe.disable()
        if getattr(self, "captures", None) is not None:
            self.captures.close()
        if self.hooks is not None:
            self.hooks.uninstall()
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop()
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
    port: int | None = None, bind: str | None = None, auto: bool = True, phase_every: int | None = None
) -> Agent | None:
    """Start the agent in this process (once). Returns at once; never raises into training.

    port: the request port (batches go out on port + 1); default $TORCHTOP_PORT or a free pair.
    bind: default $TORCHTOP_BIND or 127.0.0.1. auto: install the zero-code hooks.
    phase_every: time the phases of every step (1), of about 1 step in N (N), or by step time
    (0, the default, or $TORCHTOP_PHASE_EVERY): every step of 10 ms or more, a random sample of
    faster ones. Every step's end and wall time is logged whatever this says.
    """
    global _agent
    try:
        with _lock:
            if _agent is not None:
                return _agent
            try:
                import torch
            except Exception as exc:
                warn(
                    f"torch is not importable ({exc}); install torch (pip install 'torchtop[torch]'); the agent is off"
                )
                return None
            if port is None and os.environ.get("TORCHTOP_PORT"):
                port = _env_int("TORCHTOP_PORT", 0) or None
            bind = bind or os.environ.get("TORCHTOP_BIND") or "127.0.0.1"
            from torchtop.agent.loop.sockets import BindError

            try:
                if phase_every is None:
                    phase_every = _env_int("TORCHTOP_PHASE_EVERY", 0)
                _agent = Agent(torch, port, bind, auto, phase_every)
            except BindError as exc:
                warn(f"{exc}; training continues without torchtop")
                return None
            if not os.environ.get("TORCHTOP_QUIET"):
                warn(
                    f"agent on {bind}:{_agent.port} (pid {_agent.pid}); attach with: torchtop attach {_agent.pid}"
                )
            return _agent
    except Exception as exc:  # never into training
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
    except Exception as exc:
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
        except Exception:
            pass


atexit.register(stop)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
