"""`torchtop replay`: the TUI over a recording plays, pauses, changes speed, seeks and jumps."""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.widgets import TabbedContent

from tests.recording_util import T0, write
from tests.tui_util import wait_for
from torchtop.monitor.commands.cli import main
from torchtop.monitor.model.playback import load
from torchtop.monitor.tui.playback_app import PlaybackApp, clock, jump_target


@pytest.fixture
def recording(tmp_path: Path) -> Path:
    write(tmp_path, 600, data_share=0.6)  # 60 s, 100 steps/s, data-bound
    return tmp_path


@pytest.mark.slow  # among the fast subset's slowest (issue 27: the subset under 90 s)
async def test_replay_plays_pauses_seeks_and_jumps(recording: Path) -> None:
    playback, _ = load(recording)
    app = PlaybackApp(playback, speed=8.0)
    async with app.run_test(size=(120, 40)) as pilot:
        assert await wait_for(pilot, lambda: app.position - T0 > 4.0, 10)
        assert app.state.steps and app.state.steps[-1].i > 100

        await pilot.press("space")
        await pilot.pause(0.2)
        paused_at = app.position
        await pilot.pause(0.5)
        assert app.paused and app.position == paused_at
        assert "paused" in app.status_line.connection

        await pilot.press("right_square_bracket")
        assert app.speed == 16.0
        await pilot.press("left_square_bracket", "left_square_bracket")
        assert app.speed == 4.0

        await pilot.press("right")
        assert app.position == pytest.approx(paused_at + 10.0)

        await pilot.press("g")
        await pilot.pause(0.2)
        await pilot.press(*"#3000", "enter")
        await pilot.pause(0.2)
        assert app.position == pytest.approx(playback.time_of_step(3000))
        last = app.state.steps[-1].i
        assert 2990 <= last <= 3009, last  # the step the jump asked for is the newest one shown
        # the windows are full at the target: the step panel shows 10 s of the run, 100 steps/s
        app.refresh_panels()
        assert app.step_panel.stats["steps_per_s"] == pytest.approx(100.0, rel=0.05)
        assert app.diagnosis is not None and app.diagnosis.verdict.kind == "data-loading"

        await pilot.press("end")
        assert app.position == playback.end
        assert f"{clock(playback.end - T0)} / {clock(playback.end - T0)}" in app.replay_text()


def test_jump_targets(recording: Path) -> None:
    playback, _ = load(recording)
    assert jump_target(playback, "#100", T0) == pytest.approx(T0 + 1.0, abs=0.11)
    assert jump_target(playback, "step 100", T0) == jump_target(playback, "#100", T0)
    assert jump_target(playback, "1:30", T0) == T0 + 90
    assert jump_target(playback, "+10s", T0 + 5) == T0 + 15
    assert jump_target(playback, "-0:05", T0 + 10) == T0 + 5
    with pytest.raises(ValueError):
        jump_target(playback, "soon", T0)


def test_replay_of_a_missing_recording_says_what_is_wrong(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", str(tmp_path / "nothing")]) == 2
    assert "no such file or directory" in capsys.readouterr().err


def two_rank_job(tmp_path: Path) -> Path:
    job = tmp_path / "job"
    for rank, data in ((0, 0.0), (1, 0.4)):
        write(job, 120, rank=rank, data_share=data)  # 1200 steps of each rank, 12 s
    return job


def test_report_of_a_job_recording_is_the_job_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    job = two_rank_job(tmp_path)
    assert main(["report", str(job), "--seconds", "5"]) == 0
    out = capsys.readouterr()
    report = json.loads(out.out)
    assert [e["rank"] for e in report["ranks"]] == [0, 1] and "reporting rank 0" not in out.err
    assert report["ranks"][1]["breakdown"]["data"] > 0.3 > report["ranks"][0]["breakdown"]["data"]
    assert report["job"]["steps"] > 0 and "collective" in report
    assert main(["report", str(job), "--rank", "1", "--seconds", "5"]) == 0  # one rank, as before
    assert json.loads(capsys.readouterr().out)["breakdown"]["data"] > 0.3


async def test_replay_of_a_job_recording_shows_the_job_view(tmp_path: Path) -> None:
    from torchtop.contract.recording_reader import open_recording
    from torchtop.monitor.model.job_playback import JobPlayback
    from torchtop.monitor.tui.job_replay_app import JobReplayApp

    app = JobReplayApp(
        JobPlayback(open_recording(two_rank_job(tmp_path))), speed=1.0
    )  # still playing at space
    async with app.run_test(size=(120, 40)) as pilot:
        assert await wait_for(pilot, lambda: len(app.job.ranked()) == 2 and app.job.job.steps, 20)
        await pilot.press("space")  # paused: the seek stays where it went
        assert app.paused
        app.seek(T0 + 6)
        await pilot.pause()
        assert app.query_one("#tabs", TabbedContent).active == "ranks"
        assert app.job.job.steps and abs(app.position - (T0 + 6)) < 0.01
        await pilot.press("right_square_bracket")
        member = app.shown_member()
        assert member is not None and member.rank == 0
        await pilot.press("p")
        await pilot.pause(0.2)
        assert "replay of a 2-rank job" in app.status_line.connection
