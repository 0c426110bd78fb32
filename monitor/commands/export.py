"""`torchtop export`: headless, many agents' figures as Prometheus and/or OpenTelemetry metrics.

    torchtop export                                  # every local agent (new ranks picked up), :9464/metrics
    torchtop export 4711 node2:5555 --prometheus 0.0.0.0:9464 --job llama-ft
    torchtop export --otlp http://localhost:4318/v1/metrics

Once a second each agent's recent window (--window S, default 10 s) becomes samples
(export/figures.py); scrapes and OTLP pushes read the latest. Each agent's steps are replayed
within a budget (link/fleet.py), so CPU and memory stay bounded whatever the step rate.
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchtop.monitor.export.figures import Sample
    from torchtop.monitor.link.fleet import Fleet

EXIT_USAGE = 2
DEFAULT_PROMETHEUS = "127.0.0.1:9464"
PUBLISH_S = 1.0
MISSING = "the exporters need the `export` extra: pip install 'torchtop[export]'"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from torchtop.monitor.commands.args import listen, seconds

    p.add_argument(
        "targets", nargs="*", help="pids, HOST:PORT, tcp:// or ssh:// targets (default: every local agent)"
    )
    p.add_argument(
        "--prometheus",
        metavar="[ADDR:]PORT",
        default=None,
        type=listen,
        help=f"serve /metrics there (default {DEFAULT_PROMETHEUS} unless --otlp is given)",
    )
    p.add_argument(
        "--otlp",
        metavar="URL",
        default=None,
        help="push OTLP/HTTP metrics, e.g. http://localhost:4318/v1/metrics",
    )
    p.add_argument(
        "--otlp-interval", type=seconds, default=5.0, help="seconds between OTLP pushes (default 5)"
    )
    p.add_argument("--job", default=None, help="the job label (default: the training script's name)")
    p.add_argument("--window", type=seconds, default=10.0, help="seconds each figure summarises (default 10)")
    p.add_argument(
        "--seconds", type=seconds, default=None, help="stop after S seconds (default: run until Ctrl-C)"
    )
    p.add_argument(
        "--store",
        metavar="HOST:PORT",
        default=None,
        help="a job: its nodes from the relays in its rendezvous store (or give its nodes as ssh:// targets)",
    )
    p.add_argument(
        "--top",
        type=int,
        default=None,
        metavar="K",
        help="a job: per-rank series for the K slowest ranks only (and any not reporting)",
    )


def _listen(spec: str | tuple[str, int]) -> tuple[str, int]:
    from torchtop.monitor.commands.args import listen

    return spec if isinstance(spec, tuple) else listen(spec)


def job_label(argv: list[str]) -> str:
    from torchtop.monitor.commands.run import job_name

    return job_name(argv) if argv else "torchtop"


def fleet_samples(
    fleet: Fleet,
    window: float,
    job: str | None,
    verdicts: dict[str, Any] | None = None,
    events: dict[str, Any] | None = None,
) -> list[Sample]:
    """Every watched agent's samples, from its state's report over the last `window` seconds;
    `verdicts`: each job's and agent's verdict in force, updated (hysteresis, as live); `events`:
    each agent's event log, updated (the verdict it exports: a rank of a job, the job's)."""
    from torchtop.monitor.diagnosis.job_diagnosis import diagnose_job, rank_times

    verdicts = {} if verdicts is None else verdicts
    judged = {}
    for job_id, job_state in fleet.jobs.items():
        if len(job_state.live()) > 1:
            verdicts[job_id], found = diagnose_job(job_state, verdicts.get(job_id), window)
            judged[job_id] = (verdicts[job_id], found, rank_times(job_state, window))
    out: list[Sample] = []
    for w in fleet.agents.values():
        if w.hello is None:
            continue
        in_job = judged.get(w.hello.job_id) if w.hello.job_id else None
        label = job or job_label(w.hello.argv)
        rate = w.budget.rate_now() if w.up else 0.0
        out += agent_samples(
            w.state,
            w.hello,
            w.endpoint.address,
            label,
            w.up,
            w.budget.steps,
            rate,
            window,
            verdicts,
            events,
            in_job,
        )
    if events is not None:  # agents gone from the fleet: their logs go too
        for gone in set(events) - {w.endpoint.address for w in fleet.agents.values()}:
            del events[gone]
    return out


def agent_samples(
    state: Any,
    hello: Any,
    key: str,
    label: str,
    up: bool,
    steps_total: int,
    steps_per_s: float | None,
    window: float,
    verdicts: dict[str, Any],
    events: dict[str, Any] | None = None,
    in_job: tuple[Any, Any, Any] | None = None,
) -> list[Sample]:
    """One agent's samples (its RunState and Hello): its report over the last `window` seconds
    with the verdict in force (`verdicts[key]`, updated); a rank of a job judged in `in_job`
    carries the job's verdict; `events[key]`, its event log, observes the verdict it exports."""
    from torchtop.monitor.diagnosis.events import EventLog, stalled_s
    from torchtop.monitor.diagnosis.job_diagnosis import rank_view
    from torchtop.monitor.diagnosis.report import diagnose, run_report, with_diagnosis
    from torchtop.monitor.diagnosis.window import choose
    from torchtop.monitor.export.figures import samples

    chosen = choose(state, window)  # the figures and the verdict: one window, one fold
    own = diagnose(state, verdicts.get(key), window=chosen)
    verdicts[key] = own
    report = run_report(state, window, chosen=chosen, judged=own)
    shown = own
    if in_job is not None:  # a rank of a job carries the job's verdict (its own flags)
        job_diagnosis, found, times = in_job
        shown = rank_view(job_diagnosis, own, hello.rank, found, times)
    with_diagnosis(report, shown)
    log = None
    if events is not None:
        log = events.setdefault(key, EventLog())
        log.observe(shown, state.agent_time)
    return samples(
        report, label, hello.host, hello.rank, up, steps_total, steps_per_s, log, stalled_s([state])
    )


def _job_targets(args: argparse.Namespace) -> list[str] | None:
    """A job's targets (its nodes) when the export is about a job; None for agents one by one."""
    from torchtop.monitor.link import ssh

    remote = [t for t in args.targets if ssh.is_ssh(t)]
    if args.store:
        from torchtop.monitor.link.relay_targets import relays_from_store
        from torchtop.monitor.link.store import parse_store

        args.job_id, found = relays_from_store(parse_store(args.store), None)
        return found
    return remote if len(remote) > 1 else None


def _run_job(args: argparse.Namespace, targets: list[str], board: Any) -> Any:
    """Open the job and return a poll function that publishes its samples once a second."""
    from torchtop.monitor.export.job_figures import job_samples
    from torchtop.monitor.link.job_link import JobLink, apply_events
    from torchtop.monitor.link.job_targets import open_job
    from torchtop.monitor.model.job_state import JobState

    stack = ExitStack()
    plan = stack.enter_context(open_job(targets, getattr(args, "job_id", None), args.ssh_option or ()))
    link = JobLink(plan.endpoints, snapshot_steps=0, relays=plan.relays)
    stack.callback(link.close)
    job = JobState(plan.job_id)
    publish_at = [0.0]
    verdicts: dict[str, Any] = {}  # the verdict in force: the next judgement's hysteresis
    events: dict[str, Any] = {}  # the job's event log: its counter across refreshes

    def poll() -> None:
        apply_events(job, link.poll(0.2), time.monotonic())
        now = time.monotonic()
        if now >= publish_at[0]:
            publish_at[0] = now + PUBLISH_S
            board.publish(
                job_samples(job, args.window, args.job or job.job_id, now, args.top, verdicts, events)
            )

    return stack, poll


def _stop_on_sigterm() -> Any:
    """SIGTERM raises KeyboardInterrupt while the export runs; the previous handler, to restore."""
    import signal
    import threading

    def stop(_sig: int, _frame: object) -> None:
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, stop)


def run(args: argparse.Namespace) -> int:
    from torchtop.monitor.export.figures import SampleBoard

    prometheus = args.prometheus or (None if args.otlp else DEFAULT_PROMETHEUS)
    board = SampleBoard()
    previous = _stop_on_sigterm()  # a service manager's stop: the tunnels and servers close as on Ctrl-C
    try:
        return _run(args, prometheus, board)
    finally:
        if previous is not None:
            import signal

            signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace, prometheus: str | None, board: Any) -> int:
    from torchtop.monitor.link.client import AgentUnreachable
    from torchtop.monitor.link.fleet import Fleet
    from torchtop.monitor.link.remote import open_target, target_options
    from torchtop.monitor.link.targets import TargetError

    addr, port = _listen(prometheus) if prometheus else ("", 0)
    with ExitStack() as stack:
        job_poll = None
        try:
            targets = _job_targets(args)
            if targets is not None:
                job_stack, job_poll = _run_job(args, targets, board)
                stack.enter_context(job_stack)
                endpoints = []
            else:
                endpoints = [
                    stack.enter_context(open_target(t, **target_options(args))) for t in args.targets
                ]
        except (TargetError, AgentUnreachable, ValueError) as exc:
            print(f"torchtop: {exc}", file=sys.stderr)
            return EXIT_USAGE
        fleet = Fleet(endpoints, discover=not args.targets and job_poll is None)
        stack.callback(fleet.close)
        try:
            if prometheus:
                from torchtop.monitor.export.prometheus import serve

                server, _ = serve(board, port, addr)
                stack.callback(server.shutdown)
                print(
                    f"torchtop export: Prometheus metrics on http://{addr}:{port}/metrics",
                    file=sys.stderr,
                    flush=True,
                )
            if args.otlp:
                from torchtop.monitor.export.otlp import start

                provider = start(board, args.otlp, args.otlp_interval)
                stack.callback(provider.shutdown)
                print(f"torchtop export: OTLP metrics to {args.otlp}", file=sys.stderr, flush=True)
        except ImportError:
            print(f"torchtop: {MISSING}", file=sys.stderr)
            return EXIT_USAGE
        except (OSError, ValueError) as exc:
            print(f"torchtop: cannot serve metrics on {addr}:{port}: {exc}", file=sys.stderr)
            return EXIT_USAGE
        end = None if args.seconds is None else time.monotonic() + args.seconds
        publish_at = 0.0
        verdicts: dict[str, Any] = {}  # each job's and agent's verdict in force (hysteresis)
        events: dict[str, Any] = {}  # each agent's event log: its counter across refreshes
        try:
            while end is None or time.monotonic() < end:
                if job_poll is not None:
                    job_poll()
                    continue
                fleet.poll(0.2)
                if time.monotonic() >= publish_at:
                    publish_at = time.monotonic() + PUBLISH_S
                    board.publish(fleet_samples(fleet, args.window, args.job, verdicts, events))
        except KeyboardInterrupt:
            pass
    return 0
