"""Issue 38 item 1: the hung collective named from torch's flight recorder.

The agent's side (agent/telemetry/flight.py): a dump reduced to each process group's place (a
captured gloo dump, an NCCL-shaped one), read only while the steps have stopped, at most every
READ_EVERY_S, a failing dump said once and never raised; the buffer set at start where the user
set none. The contract bounds what is sent. The monitor's side (monitor/diagnosis/stall.py): the
rank whose last sequence number is below the others' is named as holding the job, the others as
waiting in the collective by its number; without flight data, the stacks' words stay.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tests.rank_util import hello
from torchtop.agent.telemetry import flight
from torchtop.agent.telemetry.flight import FlightReader, reduce_dump
from torchtop.agent.telemetry.stacks import OTHER
from torchtop.contract import wire
from torchtop.contract.logcodes import COMM
from torchtop.contract.telemetry import MAX_COLLECTIVE_GROUPS, MAX_COLLECTIVE_TEXT, Collective, Telemetry
from torchtop.contract.why import StackSample
from torchtop.monitor.diagnosis.facts import Facts
from torchtop.monitor.diagnosis.stall import job_stall, rule_stalled, run_stall
from torchtop.monitor.model.state import RunState
from torchtop.monitor.model.steps import StepRecord

DATA = Path(__file__).parent / "data"
NOW_NS = 1_800_000_000 * 10**9
STEP_S = 0.1
TRAIN = "/job/train.py:57 main"
SLEEP = "/job/train.py:42 wait_here"
ITEM = "/job/train.py:60 main"


# -- the agent's reducer ---------------------------------------------------------------------------
def test_a_gloo_dump_gives_each_groups_last_collective() -> None:
    dump = json.loads((DATA / "flight_gloo.json").read_text())  # torch 2.13, gloo, two groups
    last = max(e["time_created_ns"] for e in dump["entries"])
    got = {c.group: c for c in reduce_dump(dump, last + 3 * 10**9)}
    assert set(got) == {"default_pg", "dp"}
    d, dp = got["default_pg"], got["dp"]
    assert (d.op, d.seq, d.last_seq, d.state) == ("barrier", 4, 4, "")  # gloo's states say nothing
    assert (dp.op, dp.seq, dp.last_seq) == ("broadcast", 2, 2)
    assert d.group_id != dp.group_id
    assert 2.9 < d.age_s < 3.1  # since the named one was entered


def _nccl(
    states: list[str], group: str = "dp", gid: str = "1", op: str = "nccl:all_reduce"
) -> list[dict[str, Any]]:
    return [
        {
            "collective_seq_id": i + 1, "p2p_seq_id": 0, "is_p2p": False, "op_id": i + 1,
            "pg_id": int(gid), "process_group": [gid, group], "profiling_name": op, "state": s,
            "time_created_ns": NOW_NS - (len(states) - i) * 10**9, "retired": s == "completed",
        }
        for i, s in enumerate(states)
    ]  # fmt: skip


def test_an_nccl_dump_names_the_oldest_collective_not_completed() -> None:
    entries = _nccl(["completed"] * 9 + ["started", "scheduled"])
    p2p = copy.deepcopy(entries[-1]) | {"is_p2p": True, "collective_seq_id": 0, "p2p_seq_id": 7}
    other = _nccl(["completed"] * 3, group="undefined", gid="2", op="nccl:_allgather_base")
    got = {c.group_id: c for c in reduce_dump({"entries": [*entries, p2p, *other]}, NOW_NS)}
    dp = got["1"]
    assert (dp.group, dp.op, dp.seq, dp.last_seq, dp.state) == ("dp", "all_reduce", 10, 11, "started")
    assert dp.age_s == pytest.approx(2.0)
    done = got["2"]  # every one completed: its last; a group without a desc by its id
    assert (done.group, done.op, done.seq, done.state) == ("pg 2", "_allgather_base", 3, "completed")


def test_a_dump_is_bounded_and_odd_entries_are_skipped() -> None:
    entries = [e for g in range(40) for e in _nccl(["started"], group="g" * 200, gid=str(g + 1))]
    entries += [{"collective_seq_id": "x"}, {"collective_seq_id": -1}, "junk", {"is_p2p": True}]
    got = reduce_dump({"entries": entries}, NOW_NS)
    assert len(got) == MAX_COLLECTIVE_GROUPS
    assert all(len(c.group) == MAX_COLLECTIVE_TEXT for c in got)
    assert reduce_dump({"entries": "none"}, NOW_NS) == [] and reduce_dump({}, NOW_NS) == []
    # what is sent decodes; more than the bound, or a longer name, is refused at the door
    tel = Telemetry(time=1.0, collectives=got)
    frame = wire.encode(wire.Batch(v=wire.PROTOCOL_VERSION, run_id="r", seq=0, time=1.0, telemetry=tel))
    batch = wire.decode(frame)
    assert isinstance(batch, wire.Batch) and batch.telemetry is not None
    assert batch.telemetry.collectives == got
    for bad in (got * 2, [msgspec.structs.replace(got[0], op="o" * 100)]):
        hostile = wire.Batch(
            v=wire.PROTOCOL_VERSION, run_id="r", seq=0, time=1.0, telemetry=Telemetry(1.0, collectives=bad)
        )
        with pytest.raises(wire.WireError):
            wire.decode(wire.encode(hostile))
    # an old peer's telemetry has no such field; an empty one is not sent
    assert b"collectives" not in msgspec.msgpack.encode(Telemetry(time=1.0))


# -- when the agent reads --------------------------------------------------------------------------
class _Dump:
    def __init__(self, raw: bytes | Exception) -> None:
        self.raw, self.calls = raw, 0

    def __call__(self) -> bytes:
        self.calls += 1
        if isinstance(self.raw, Exception):
            raise self.raw
        return self.raw


def _stepping(reader: FlightReader, steps: int = 20, pace: float = 0.05) -> float:
    for i in range(steps):
        reader.poll(i, 100.0 + i * pace)
    return 100.0 + (steps - 1) * pace


def test_the_dump_is_read_only_while_stalled_and_at_most_every_two_seconds() -> None:
    dump = _Dump(json.dumps({"entries": _nccl(["completed", "started"])}).encode())
    reader = FlightReader(lambda: dump)
    t = _stepping(reader)
    assert dump.calls == 0  # stepping: never read
    reader.poll(19, t + flight.STALL_MIN_S * 0.9)
    assert dump.calls == 0 and reader.groups == []
    reader.poll(19, t + flight.STALL_MIN_S)
    assert dump.calls == 1 and [(c.op, c.seq) for c in reader.groups] == [("all_reduce", 2)]
    reader.poll(19, t + flight.STALL_MIN_S + flight.READ_EVERY_S / 2)
    assert dump.calls == 1
    reader.poll(19, t + flight.STALL_MIN_S + flight.READ_EVERY_S)
    assert dump.calls == 2
    reader.poll(20, t + 10)  # a step ended: nothing sent
    assert reader.groups == []
    # a slow run stalls at its own pace: several median steps
    slow = FlightReader(lambda: dump)
    t = _stepping(slow, pace=2.0)
    slow.poll(19, t + flight.STALL_MIN_S + 0.5)
    assert slow.groups == []
    slow.poll(19, t + flight.STALL_STEPS * 2.0)
    assert slow.groups != []


def test_a_dump_that_fails_is_said_once_and_never_raised() -> None:
    dump = _Dump(RuntimeError("boom"))
    reader = FlightReader(lambda: dump)
    t = _stepping(reader)
    reader.poll(19, t + 10)
    reader.poll(19, t + 20)
    assert dump.calls == 1 and reader.groups == [] and "boom" in reader.failed
    absent = FlightReader(lambda: None)  # a torch without the call, or no process group
    t = _stepping(absent)
    absent.poll(19, t + 10)
    assert absent.groups == [] and not absent.failed
    garbled = FlightReader(lambda: _Dump(b"[1, 2]"))
    t = _stepping(garbled)
    garbled.poll(19, t + 10)
    assert garbled.groups == [] and garbled.failed


def test_the_buffer_is_set_where_the_user_set_none() -> None:
    env: dict[str, str] = {}
    assert flight.enable(env) and env == {flight.ENV: str(flight.BUFFER)}
    for mine in ({flight.ENV: "0"}, {flight.OLD_ENV: "100"}):
        env = dict(mine)
        assert flight.enable(env) and env == mine  # the user's own setting stands
    env = {flight.OPT_OUT: "0"}
    assert not flight.enable(env) and env == {flight.OPT_OUT: "0"}


@pytest.mark.slow  # a process group's set-up in a child: ~3 s here
def test_a_real_process_group_is_read_through_torchs_call(tmp_path: Path) -> None:
    """In a process of its own: a process that made other groups before keeps their entries in the
    recorder (the test process does, from other tests), and their sequence numbers go on."""
    code = f"""
import json, torch, torch.distributed as dist
from torchtop.agent.telemetry import flight
from torchtop.agent.telemetry.flight import FlightReader
dist.init_process_group("gloo", init_method="file://{tmp_path / "store"}", rank=0, world_size=1)
t = torch.ones(2)
for _ in range(3):
    dist.all_reduce(t)
reader = FlightReader()
assert flight.torch_dump() is not None
got = reader.read()
dist.destroy_process_group()
print(json.dumps({{"failed": reader.failed, "got": [[c.group, c.op, c.seq] for c in got]}}))
"""
    env = dict(os.environ, TORCH_FR_BUFFER_SIZE="2000")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["failed"] == ""
    assert out["got"] == [["default_pg", "all_reduce", 3]]


# -- the monitor's words ---------------------------------------------------------------------------
def _state(rank: int, world: int, collectives: list[Collective], where: tuple[int, str, str]) -> RunState:
    """60 steps, then 14 s without a step end sampled at 10 Hz at `where`, with this flight data."""
    st = RunState()
    st.hello = hello(rank, world, job_id="j")
    for i in range(60):
        st.steps.append(StepRecord(i=i, t0=1000 + i * STEP_S, wall_ns=int(STEP_S * 1e9), phases={}))
    end = 1000 + 60 * STEP_S
    for k in range(1, 141):
        st.why.samples.append((end + k / 10, StackSample(int((end + k / 10) * 1e9), *where)))
    st.agent_time = end + 14
    st.telemetry = Telemetry(time=end + 14, collectives=collectives)
    return st


def _coll(
    seq: int,
    last: int | None = None,
    state: str = "",
    age: float = 12.0,
    group: str = "default_pg",
    op: str = "all_reduce",
) -> Collective:
    return Collective(group, group, op, seq, seq if last is None else last, state, age)


IN_ALL_REDUCE = (COMM, TRAIN, "torch.distributed:all_reduce")
SLEEPING = (OTHER, SLEEP, "time.sleep")


def test_a_gloo_job_names_the_rank_that_never_arrived_and_the_sequence_number() -> None:
    states = {r: _state(r, 3, [_coll(1841)], IN_ALL_REDUCE) for r in (0, 2)}
    states[1] = _state(1, 3, [_coll(1840, age=14.5)], SLEEPING)
    f = job_stall(states)
    assert f is not None and f.kind == "stalled"
    assert f.evidence[1].startswith(
        "rank 1 is in `time.sleep` at train.py:42 wait_here, outside any collective"
    )
    assert f.evidence[2] == "ranks 0, 2 wait in all_reduce #1841 since 12 s"
    assert f.advice[0].startswith("rank 1 holds the job")
    # a rank's own line has the number too
    own = run_stall(states[0])
    facts = Facts(steps=50, step_ms=STEP_S * 1e3, shares={}, ms={}, stall=own)
    found = rule_stalled(facts, 1.0)
    assert found is not None and "waits in all_reduce #1841 at train.py:57 main" in found.evidence[1]
    # without flight-recorder data the stacks' words stay
    for st in states.values():
        st.telemetry = Telemetry(time=1.0)
    f = job_stall(states)
    assert f is not None and f.evidence[2] == "ranks 0, 2 wait in all_reduce since 14 s"


def test_an_nccl_job_waiting_outside_a_collective_frame_is_not_blamed() -> None:
    """NCCL's all_reduce returns at once: the waiting rank's thread blocks later, in `.item()`,
    outside any collective frame; its flight recorder has #1841 started, the hung rank's last
    completed one is #1840. The stacks alone named both ranks as holding the job."""
    item = (OTHER, ITEM, "torch._C:TensorBase.item")
    ahead = [_coll(1841, last=1842, state="started", age=13.0, group="dp")]
    states = {
        0: _state(0, 2, ahead, item),
        1: _state(1, 2, [_coll(1840, state="completed", age=15.0, group="dp")], SLEEPING),
    }
    f = job_stall(states)
    assert f is not None
    ranks = [e for e in f.evidence if e.startswith("rank")]
    assert ranks[0].startswith("rank 1 is in `time.sleep` at train.py:42 wait_here, outside any collective")
    assert ranks[1] == "rank 0 waits in all_reduce #1841 (group dp) since 13 s"
    assert len(ranks) == 2 and f.advice[0].startswith("rank 1 holds the job")
    own = rule_stalled(
        Facts(steps=50, step_ms=STEP_S * 1e3, shares={}, ms={}, stall=run_stall(states[0])), 1.0
    )
    assert own is not None and "waits in all_reduce #1841 (group dp) at train.py:60 main" in own.evidence[1]


def test_a_rank_stuck_in_another_collective_is_named_by_the_one_it_never_entered() -> None:
    other = _coll(7, state="started", age=14.0, group="pp", op="broadcast")
    states = {
        0: _state(0, 2, [_coll(1841, state="started")], (COMM, TRAIN, "torch.distributed:all_reduce")),
        1: _state(1, 2, [_coll(1840, state="completed"), other], (COMM, ITEM, "torch.distributed:broadcast")),
    }
    f = job_stall(states)
    assert f is not None
    assert f.evidence[1].startswith(
        "rank 1 never entered all_reduce #1841: it is in broadcast #7 (group pp) at train.py:60"
    )
    assert f.evidence[2] == "rank 0 waits in all_reduce #1841 since 12 s"
