"""Issue 38 item 1, hangs and stalls (monitor/diagnosis/stall.py): a run with no step end for
several median steps is `stalled`, said with where its training thread is (its stack samples:
inside a collective or outside any); a job stalls when every rank does, the ranks outside any
collective named first and no straggler named from it; a stall that ended is said as resumed.
The agent's side: a collective wrapper's frame says `comm` and the collective's name, and a
frame blocked in a C function names the call."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import torch

from tests.rank_util import hello
from torchtop.agent.hooks.collectives import timed_collective
from torchtop.agent.hooks.frames import classifier_for
from torchtop.agent.hooks.probe import Probe
from torchtop.agent.telemetry.stacks import OTHER, StackSampler
from torchtop.contract.logcodes import COMM
from torchtop.contract.why import StackSample
from torchtop.monitor.diagnosis.catalogue import VERDICT_WORDS
from torchtop.monitor.diagnosis.facts import THRESHOLDS as T
from torchtop.monitor.diagnosis.facts import Facts
from torchtop.monitor.diagnosis.job_diagnosis import diagnose_job
from torchtop.monitor.diagnosis.stall import job_stall, limit_s, rule_stalled, run_stall
from torchtop.monitor.model.job_state import JobState
from torchtop.monitor.model.state import RunState
from torchtop.monitor.model.steps import StepRecord

STEP_S = 0.1
TRAIN = "/job/train.py:57 main"
SLEEP = "/job/train.py:42 wait_here"


def _state(rank: int = 0, world: int = 1, n: int = 60, t0: float = 1000.0) -> RunState:
    """`n` steps of STEP_S from t0, the agent's clock at the last one's end."""
    st = RunState()
    st.hello = hello(rank, world, job_id="j")
    for i in range(n):
        st.steps.append(StepRecord(i=i, t0=t0 + i * STEP_S, wall_ns=int(STEP_S * 1e9), phases={}))
    st.agent_time = t0 + n * STEP_S
    return st


def _sample(st: RunState, t: float, phase: int, site: str, callee: str) -> None:
    st.why.samples.append((t, StackSample(int(t * 1e9), phase, site, callee)))


def _silent(st: RunState, seconds: float, phase: int, site: str, callee: str) -> None:
    """No step end for `seconds`, sampled at 10 Hz where the thread is."""
    end = st.agent_time
    for k in range(1, int(seconds * 10) + 1):
        _sample(st, end + k / 10, phase, site, callee)
    st.agent_time = end + seconds


def _facts(st: RunState) -> Facts:
    return Facts(steps=50, step_ms=STEP_S * 1e3, shares={}, ms={}, stall=run_stall(st))


def test_stalled_at_its_threshold() -> None:
    limit = limit_s(STEP_S * 1e3)
    assert limit == max(T.stall_min_s, T.stall_steps * STEP_S)
    under = _state()
    _silent(under, limit * 0.9, OTHER, SLEEP, "time.sleep")
    assert rule_stalled(_facts(under), 1.0) is None
    over = _state()
    _silent(over, limit * 1.5, OTHER, SLEEP, "time.sleep")
    f = rule_stalled(_facts(over), 1.0)
    assert f is not None and f.kind == "stalled" and f.severity == "critical"
    assert f.evidence[0].startswith("no step end for ")
    # a single process: no "outside any collective"
    assert f.evidence[1].startswith("the training thread is in `time.sleep` at train.py:42 wait_here")
    assert "collective" not in f.evidence[1]
    assert VERDICT_WORDS["stalled"][0] == "Stalled"


def test_a_long_save_is_said_as_saving_not_as_a_hang() -> None:
    """A torch.save longer than five median steps: its samples are in the checkpoint phase."""
    from torchtop.contract.logcodes import SAMPLE_CHECKPOINT

    st = _state()
    _silent(st, 30, SAMPLE_CHECKPOINT, "/job/train.py:80 save_every", "torch.serialization:save")
    f = rule_stalled(_facts(st), 1.0)
    assert f is not None and f.severity == "warning", f
    assert f.evidence[1].startswith("the training thread is saving a checkpoint, in `"), f.evidence
    assert "train.py:80" in f.evidence[1] and any("async_save" in a for a in f.advice)


def test_a_slow_run_stalls_at_its_own_pace() -> None:
    """Five median steps of a slow run are not a stall before they pass."""
    st = RunState()
    for i in range(20):
        st.steps.append(StepRecord(i=i, t0=1000.0 + 4 * i, wall_ns=int(4e9), phases={}))
    st.agent_time = 1080.0 + 12.0  # 12 s without a step end: 3 median steps
    assert run_stall(st) is None
    st.agent_time = 1080.0 + 21.0
    s = run_stall(st)
    assert s is not None and s.ended is None and s.where is None


def test_the_rule_wins_the_selection() -> None:
    from torchtop.monitor.diagnosis.selection import primary

    st = _state()
    _silent(st, 30, OTHER, SLEEP, "time.sleep")
    f = _facts(st)
    f.shares, f.ms = {"other": 0.9, "forward": 0.1}, {"other": 90.0, "forward": 10.0}
    assert primary(f).kind == "stalled"


def test_a_job_names_the_rank_outside_the_collectives() -> None:
    states = {r: _state(r, 3) for r in range(3)}
    _silent(states[1], 14, OTHER, SLEEP, "time.sleep")
    for r in (0, 2):
        _silent(states[r], 14, COMM, TRAIN, "torch.distributed:all_reduce")
    f = job_stall(states)
    assert f is not None and f.kind == "stalled"
    assert f.evidence[1].startswith(
        "rank 1 is in `time.sleep` at train.py:42 wait_here, outside any collective"
    )
    assert f.evidence[2] == "ranks 0, 2 wait in all_reduce since 14 s"
    assert f.advice[0].startswith("rank 1 holds the job")
    # one rank still stepping: not a job stall
    states[2] = _state(2, 3, n=200)
    assert job_stall(states) is None


def test_a_stalled_job_names_no_straggler() -> None:
    """Issue 38: a hung rank's job read "straggler ... rank 0 is late": the waiting rank blamed."""
    job = JobState("j")
    for r in range(3):
        m = job.member(f"rank{r}")
        m.state.apply_hello(hello(r, 3, job_id="j"))
        st = _state(r, 3)
        m.state.steps, m.state.agent_time = st.steps, st.agent_time
        _silent(m.state, 20, COMM if r != 1 else OTHER, TRAIN if r != 1 else SLEEP,
                "torch.distributed:all_reduce" if r != 1 else "time.sleep")  # fmt: skip
    d, found = diagnose_job(job)
    assert d.verdict.kind == "stalled" and found is None
    assert "rank 1 is in `time.sleep`" in d.verdict.evidence[1]


def test_a_stall_that_ended_is_said_as_resumed() -> None:
    from torchtop.monitor.diagnosis.stall import with_resumed

    st = _state()
    stalled_at = st.agent_time
    _silent(st, 12, OTHER, SLEEP, "time.sleep")
    st.steps.append(StepRecord(i=60, t0=stalled_at, wall_ns=int(12.05e9), phases={}))
    for i in range(61, 81):
        st.steps.append(
            StepRecord(i=i, t0=stalled_at + 12.05 + (i - 61) * STEP_S, wall_ns=int(STEP_S * 1e9), phases={})
        )
    st.agent_time = stalled_at + 12.05 + 20 * STEP_S
    f = _facts(st)
    assert rule_stalled(f, 1.0) is None
    from torchtop.monitor.diagnosis.facts import Finding

    v = with_resumed(Finding("compute", "ok", 0.5, ("fine",)), f)
    assert v.evidence[-1].startswith("resumed 2 s ago after a stall of 12 s")
    assert "`time.sleep` at train.py:42 wait_here" in v.evidence[-1]
    last = st.steps[-1]
    for k in range(1, int(T.stall_said_s / STEP_S) + 2):  # a minute more of steps: long ago, not said
        st.steps.append(
            StepRecord(i=last.i + k, t0=last.t0 + k * STEP_S, wall_ns=int(STEP_S * 1e9), phases={})
        )
    st.agent_time = st.steps[-1].t0 + STEP_S
    assert run_stall(st) is None


# -- the agent's side: where the training thread is ----------------------------------------------------
class _Thread:
    """Runs `body(probe, release)` on a thread of its own, the probe's training thread."""

    def __init__(self, body: Any) -> None:
        self.release = threading.Event()
        self.ready = threading.Event()
        self.probe = Probe(thread_id=0)  # the thread's own, made there
        self.body = body
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.probe = Probe()
        self.body(self)

    def __enter__(self) -> _Thread:
        self.thread.start()
        assert self.ready.wait(5)
        time.sleep(0.05)  # into the blocking call
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release.set()
        self.thread.join(5)


def test_a_sample_in_a_collective_says_comm_and_its_name_on_an_untimed_step() -> None:
    ev = threading.Event(), threading.Event()  # (in the collective, released)

    # torch's collective, as the classifier sees it: code of a file in torch's package
    source = (
        "def all_reduce(tensor, op=None, group=None, async_op=False):\n    ev[0].set()\n    ev[1].wait(5)\n"
    )
    where = os.path.join(os.path.dirname(torch.__file__), "distributed", "_stall_test.py")
    space: dict[str, Any] = {"ev": ev}
    exec(compile(source, where, "exec"), space)  # noqa: S102 - the test's own source
    all_reduce = space["all_reduce"]

    def body(t: _Thread) -> None:
        t.probe.untimed = 1  # nothing logged: the wrapper's frame says where
        t.ready.set()
        ev[0].clear()
        timed_collective(t.probe, all_reduce)(torch.ones(1))

    with _Thread(body) as t:
        assert ev[0].wait(5)
        s = StackSampler(t.probe, classifier_for(torch)).sample()
        ev[1].set()
    assert s is not None and s.phase == COMM and s.callee == "torch.distributed:all_reduce", s


def test_a_frame_blocked_in_a_c_function_names_the_call() -> None:
    r, w = os.pipe()

    def read_one(fd: int) -> bytes:
        return os.read(fd, 1)

    def body(t: _Thread) -> None:
        t.ready.set()
        read_one(r)

    try:
        with _Thread(body) as t:
            s = StackSampler(t.probe, classifier_for(torch)).sample()
            os.write(w, b"x")
    finally:
        os.close(r)
        os.close(w)
    assert s is not None and s.callee == "os.read" and s.site.endswith(".read_one"), s
