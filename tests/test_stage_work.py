"""Issue 35 item 6: a pipeline's slower stage compared by its work (bubble.with_stage_work): the
parameters its stage holds against the median other stage's, not "slower at the same work"."""

from __future__ import annotations

from torchtop.monitor.diagnosis.bubble import with_stage_work
from torchtop.monitor.diagnosis.facts import Finding

STRAGGLER = Finding(
    "straggler",
    "warning",
    0.3,
    (
        "rank 1: forward 19.7 ms vs 6.5 ms median",
        "the other 1 rank wait 13.2 ms a step for it in collectives: 30% of the 44.0 ms step",
        "rank 1 is slower at the same work (samples within 10%): its GPU or its host",
    ),
    ("this rank computes slower: a throttled or shared GPU (GPU · Host tab), or a bigger shard",),
)


def test_a_stage_with_three_times_the_layers_is_named_by_its_parameters() -> None:
    got = with_stage_work(STRAGGLER, 1, {0: 1_000_000, 1: 3_000_000})
    assert got.evidence[1] == (
        "the stage on rank 1 holds 3.0x the parameters of the median stage: move layers to the earlier stage"
    ), got.evidence
    assert not any("slower at the same work" in e for e in got.evidence)
    assert (
        got.evidence[0] == STRAGGLER.evidence[0] and "move layers from the stage on rank 1" in got.advice[0]
    )
    # the first of four stages: its layers go to the later ones; the median other stage is the yardstick
    first = with_stage_work(STRAGGLER, 0, {0: 2_600_000, 1: 1_000_000, 2: 1_000_000, 3: 1_300_000})
    assert (
        "holds 2.6x the parameters of the median stage: move layers to the later stages" in first.evidence[1]
    )


def test_stages_of_about_the_same_parameters_leave_the_verdict_as_it_is() -> None:
    assert with_stage_work(STRAGGLER, 1, {0: 1_000_000, 1: 1_100_000}) == STRAGGLER
    assert with_stage_work(STRAGGLER, 1, {1: 3_000_000}) == STRAGGLER  # one stage's count: nothing to compare
    assert with_stage_work(STRAGGLER, 1, {}) == STRAGGLER
