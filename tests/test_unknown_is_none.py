"""Unknown is None, never -1: the node rank without a launcher's variable, a rank's GPU figure
without telemetry."""

from __future__ import annotations

import msgspec

from tests.rank_util import feed, hello, rank_steps
from torchtop.agent.identity import from_env
from torchtop.contract.wire import Hello
from torchtop.monitor.model.job_state import JobState
from torchtop.monitor.model.ranks_view import ranks_view


def test_node_rank_unknown_is_none() -> None:
    assert from_env({"RANK": "1", "WORLD_SIZE": "2"}).node_rank is None
    assert from_env({"RANK": "1", "WORLD_SIZE": "2", "GROUP_RANK": "x"}).node_rank is None
    assert from_env({"RANK": "1", "WORLD_SIZE": "2", "GROUP_RANK": "0"}).node_rank == 0
    h = hello(0)
    assert h.node_rank is None
    # an older agent's -1 ("unknown" then) was left out as the default: it reads None too
    assert b"node_rank" not in msgspec.json.encode(h)
    assert msgspec.json.decode(msgspec.json.encode(h), type=Hello).node_rank is None


def test_ranks_view_gpu_unknown_is_none() -> None:
    job = JobState()
    feed(job, {r: rank_steps(r, n=60, step_ms=100.0, comm=5.0) for r in (0, 1)}, chunk=30)
    view = ranks_view(job, 10.0, None, 0.0)
    assert view.rows and all(row.gpu_util is None for row in view.rows)
