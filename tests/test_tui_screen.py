"""The TUI at the size users meet first (80x24: many terminals' and tmux panes' default) and at a
large one: what is on screen, how the keys reach what is not, what q and Ctrl-C do, and the
snapshots of every tab at both sizes.

Screens are read as plain text (tui_util.screen_text: what the snapshot SVGs hold), so a test
says what a user would see: a row of the phase table, a unit on the memory plot, a block glyph
where no panel is.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from textual.scrollbar import ScrollBar

from tests.test_tui_panels import app_without_feed, fed, fed_batches, hello, telemetry
from tests.tui_util import outside_the_panels, screen_text, steps
from torchtop.monitor.link.targets import Endpoint
from torchtop.monitor.tui import bindings
from torchtop.monitor.tui.app import TorchtopApp
from torchtop.monitor.tui.feed import HelloReceived
from torchtop.monitor.tui.widgets import HelpScreen
from torchtop.monitor.tui.widgets.run_header import header_lines

SMALL, LARGE = (80, 24), (160, 50)
ENDPOINT = Endpoint.tcp("127.0.0.1", 5555)  # feed=False: nothing connects to it
ARGV = ["train.py", "--lr", "3e-4", "--epochs", "10"]
PHASE_ROWS = ("■ data", "■ forward", "■ backward", "■ optimizer", "■ other")
BLOCKS = set("▁▂▃▄▅▆▇")  # eighth blocks: a scrollbar's thumb ends, or a sparkline


def the_hello() -> HelloReceived:
    return HelloReceived(hello(device_name="Fake GPU", cuda_event_every=8, argv=ARGV))


def data() -> tuple:  # type: ignore[type-arg]
    return the_hello(), fed_batches(steps(60, data=0.30, marks=True), telemetry(0))


def phase_rows_shown(text: str) -> list[str]:
    return [row for row in PHASE_ROWS if row in text]


# -- 80x24: everything fits or scrolls ------------------------------------------------------------
@pytest.mark.parametrize("key", ["pagedown", "down"])
@pytest.mark.slow  # among the fast subset's slowest, ~3.2 s here (issue 27: the subset under 60 s)
async def test_the_phase_table_below_the_fold_is_reached_with_pagedown_or_down(key: str) -> None:
    app = app_without_feed()
    async with app.run_test(size=SMALL) as pilot:
        await fed(pilot, *data())
        assert phase_rows_shown(screen_text(app)) == []  # below the fold at 80x24
        for _ in range(1 if key == "pagedown" else 40):  # Down: a line at a time, until the table shows
            await pilot.press(key)
            await pilot.pause()
            shown = screen_text(app)
            if phase_rows_shown(shown) == list(PHASE_ROWS) and re.search(r"^│\s+step\s+10\.0", shown, re.M):
                break
        text = screen_text(app)
        assert phase_rows_shown(text) == list(PHASE_ROWS), text
        assert re.search(r"^│\s+step\s+10\.0\s+100\.0%", text, re.M), text  # the total row too


@pytest.mark.slow  # among the fast subset's slowest, ~0.9 s here (issue 27: the subset under 60 s)
async def test_the_keys_scroll_the_overview_after_a_click_on_the_tab_bar() -> None:
    """A click gives the tab bar the focus; the scroll keys still reach the overview."""
    app = app_without_feed()
    async with app.run_test(size=SMALL) as pilot:
        await fed(pilot, *data())
        await pilot.click("Tab#--content-tab-overview")
        await pilot.press("end")
        await pilot.pause()
        assert phase_rows_shown(screen_text(app)) == list(PHASE_ROWS)
        await pilot.press("home")
        await pilot.pause()
        assert "step time" in screen_text(app)


@pytest.mark.slow  # among the fast subset's slowest, ~1.5 s here (issue 27: the subset under 60 s)
async def test_the_header_keeps_the_torch_version_and_the_command_at_80_columns() -> None:
    app = app_without_feed()
    async with app.run_test(size=SMALL) as pilot:
        await fed(pilot, *data())
        head = screen_text(app).splitlines()[:2]
        assert "torch 2.13.0" in head[0] and "pid 4242 @ box" in head[0], head
        assert "run run000000001" in head[1] and "train.py --lr 3e-4 --epochs 10" in head[1], head
    wide = app_without_feed()
    async with wide.run_test(size=(200, 40)) as pilot:  # one line where it fits
        await fed(pilot, *data())
        first = screen_text(wide).splitlines()[0]
        assert "torch 2.13.0" in first and "train.py --lr 3e-4 --epochs 10" in first


def test_a_cluster_nodes_header_keeps_the_torch_version_and_the_command_at_80_columns() -> None:
    """A long host name and device name: the labels and the host's domain go, not the figures."""
    node = hello(
        device_name="NVIDIA H100 80GB HBM3",
        host="gpu-node-017.cluster.example.com",
        pid=1234567,
        torch_version="2.11.0+cu130",
        world_size=8,
        rank=3,
        argv=["train.py", "--config", "configs/exp.yaml"],
    )
    lines = [line.plain[:80] for line in header_lines(node, "", 62.0, 80)]  # what 80 columns show
    assert len(lines) == 2, lines
    for shown in ("1234567 @ gpu-node-017", "cuda (NVIDIA H100 80GB HBM3)", "rank 3/8", "torch 2.11.0+cu130"):
        assert shown in "\n".join(lines), (shown, lines)
    assert "train.py --config configs/exp.yaml" in lines[1]


@pytest.mark.slow  # among the fast subset's slowest, ~0.8 s here (issue 27: the subset under 60 s)
async def test_the_memory_plot_shows_its_units_at_80x24() -> None:
    app = app_without_feed()
    async with app.run_test(size=SMALL) as pilot:
        await fed(pilot, *data())
        await pilot.press("2")
        await fed(pilot)
        text = screen_text(app)
        ticks = re.findall(r"(\d+(?:\.\d+)?) GiB┤", text)
        assert len(ticks) >= 3 and "80" in ticks, text  # the y axis in GiB, up to the device total
        assert re.search(r"-\d+(\.\d)? s\s.*\bnow\b", text), text  # the x axis in seconds, to now
        figures = app.memory_figures.plain(76)
        assert "window peak 60.0 GiB" in figures and "…" not in figures  # no figure cut short


@pytest.mark.slow  # among the fast subset's slowest (issue 27: the subset under 90 s)
@pytest.mark.parametrize("size", [SMALL, LARGE])
async def test_no_stray_glyphs_beside_the_panels_or_in_the_help(size: tuple[int, int]) -> None:
    app = app_without_feed()
    async with app.run_test(size=size) as pilot:
        await fed(pilot, *data())
        for tab in ("1", "2", "3"):
            await pilot.press(tab)
            await fed(pilot)
            assert outside_the_panels(screen_text(app)) == [], (tab, screen_text(app))
        await pilot.press("question_mark")
        await pilot.pause()
        box = help_box(screen_text(app))
        assert "Keys" in box and not BLOCKS & set(box), box


def help_box(text: str) -> str:
    """The help box's own cells (over the dashboard, whose sparklines show around it)."""
    lines = text.splitlines()
    top = next(r for r, line in enumerate(lines) if "torchtop help" in line)
    left = lines[top].index("╭")
    right = lines[top].index("╮", left)
    bottom = next(r for r in range(top, len(lines)) if lines[r][left : left + 1] == "╰")
    return "\n".join(line[left : right + 1] for line in lines[top : bottom + 1])


def test_scrollbars_draw_whole_cells() -> None:
    """The thumb's ends are whole cells at every position: no eighth-block glyph to read as junk."""
    for position in range(0, 101, 7):
        bar = ScrollBar.renderer.render_bar(size=20, virtual_size=100, window_size=23, position=position)
        assert "".join(s.text for s in bar.segments).strip() == ""


# -- the keys, as this TUI binds them ---------------------------------------------------------------
def footer_words(app: TorchtopApp) -> dict[str, str]:
    return {key: b.binding.description for key, b in app.screen.active_bindings.items() if b.binding.show}


@pytest.mark.parametrize(
    ("mode", "q_words", "ctrl_c_shown"),
    [
        ("attach", "Quit", False),
        # demo and run: among the fast subset's slowest (issue 27: the subset under 60 s)
        pytest.param("demo", "Quit+stop demo", False, marks=pytest.mark.slow),
        pytest.param("run", "Quit (job goes on)", True, marks=pytest.mark.slow),
    ],
)
async def test_footer_and_help_say_what_q_and_ctrl_c_do(
    mode: bindings.LeaveMode, q_words: str, ctrl_c_shown: bool
) -> None:
    app = TorchtopApp(endpoint=ENDPOINT, feed=False, clock=lambda: 50.0, leaving=bindings.Leaving(mode))
    async with app.run_test(size=SMALL) as pilot:
        await fed(pilot, the_hello())
        words = footer_words(app)
        assert words["q"] == q_words
        assert ("ctrl+c" in words) is ctrl_c_shown
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        help_text = app.screen.plain(100)
        q_row = next(line for line in help_text.splitlines() if line.startswith("q "))
        assert bindings.QUIT_WORDS[mode].q_help in q_row
        assert bindings.QUIT_WORDS[mode].ctrl_c_help in help_text
        assert "training goes on" not in help_text or mode == "attach"


@pytest.mark.slow  # among the fast subset's slowest, ~1.7 s here (issue 27: the subset under 60 s)
async def test_help_lists_the_tabs_this_tui_has(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    log.write_text("epoch 1\n")
    for log_path, tab_keys in ((None, "1 2 3 "), (log, "1 2 3 4 ")):
        app = TorchtopApp(endpoint=ENDPOINT, feed=False, log_path=log_path)
        async with app.run_test(size=SMALL) as pilot:
            await pilot.press("question_mark")
            for _ in range(50):  # a loaded machine may take a few frames to show the help
                await pilot.pause()
                rows = [line.strip("│ ") for line in screen_text(app).splitlines() if "tabs:" in line]
                if rows:
                    break
            assert len(rows) == 1 and rows[0].startswith(tab_keys), rows
            assert ("the job's output" in rows[0]) is (log_path is not None)


@pytest.mark.parametrize("mode", ["attach", "demo"])
async def test_ctrl_c_quits_like_q_when_the_tui_started_no_job(mode: bindings.LeaveMode) -> None:
    leaving = bindings.Leaving(mode) if mode != "attach" else None  # attach: the default
    app = TorchtopApp(endpoint=ENDPOINT, feed=False, leaving=leaving)
    async with app.run_test(size=SMALL) as pilot:
        await pilot.press("ctrl+c")
        await pilot.pause()
        assert app.return_code == 0


@pytest.mark.slow  # among the fast subset's slowest, ~1.1 s here (issue 27: the subset under 60 s)
async def test_ctrl_c_under_run_signals_the_job_then_quits() -> None:
    signalled: list[str] = []
    app = TorchtopApp(
        endpoint=ENDPOINT,
        feed=False,
        leaving=bindings.Leaving("run", lambda: signalled.append("SIGINT")),
    )
    async with app.run_test(size=SMALL) as pilot:
        await pilot.press("question_mark")  # from any screen
        await pilot.pause()
        await pilot.press("ctrl+c")
        await pilot.pause()
        assert signalled == ["SIGINT"] and app.return_code == 0
    quitter = TorchtopApp(
        endpoint=ENDPOINT,
        feed=False,
        leaving=bindings.Leaving("run", lambda: signalled.append("q?")),
    )
    async with quitter.run_test(size=SMALL) as pilot:
        await pilot.press("q")  # q leaves the job alone
        await pilot.pause()
        assert signalled == ["SIGINT"] and quitter.return_code == 0


# -- snapshots: every tab, and the help, at 80x24 and at a large size -----------------------------
@pytest.mark.parametrize("size", [SMALL, LARGE], ids=["80x24", "160x50"])
# the fast subset snapshots the first tab; the others are among its slowest (issue 27: under 60 s)
@pytest.mark.parametrize(
    "tab", ["1", *(pytest.param(t, marks=pytest.mark.slow) for t in ("2", "3", "4", "help"))]
)
def test_snapshot(snap_compare, tab: str, size: tuple[int, int], tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # the Log tab's title names its file: the same in every run
    Path("job.log").write_text("".join(f"epoch 1 step {i} loss {2 / (i + 1):.4f}\n" for i in range(40)))

    async def show(pilot) -> None:
        await fed(pilot, *data())
        await pilot.press("question_mark" if tab == "help" else tab)
        await fed(pilot)
        if tab == "4":
            pilot.app.log_tail.poll()
            await pilot.pause()

    app = TorchtopApp(
        endpoint=ENDPOINT,
        feed=False,
        clock=lambda: 50.0,
        log_path=Path("job.log"),
        leaving=bindings.Leaving("run"),
    )
    assert snap_compare(app, terminal_size=size, run_before=show)
