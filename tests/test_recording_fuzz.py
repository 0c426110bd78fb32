"""The structure-aware recording fuzzer (issue 26): a real recording, cut, flipped, overwritten,
stormed with sync words, given huge lengths, and given frames with valid CRCs around hostile
payloads (NaN and inf figures, wrong versions, wrong types, deep nesting, random msgpack). Every
reader (report, compare, trace, playback) answers each with its output or one line, never a
traceback, in bounded work (the resync's bound: recording.RESYNC_WORK)."""

from __future__ import annotations

import math
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from tests.recording_util import batch, hello, write
from torchtop.contract import recording as rec
from torchtop.contract import recording_store as store
from torchtop.contract import wire
from torchtop.monitor.commands.cli import main
from torchtop.monitor.model.playback import load

pytestmark = pytest.mark.slow
FUZZ = settings(deadline=None, database=None, max_examples=30, suppress_health_check=list(HealthCheck))  # pyright: ignore[reportArgumentType]  # hypothesis: its enum metaclass has an untyped __iter__
NAN, INF = float("nan"), float("inf")


def _base() -> bytes:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        write(Path(tmp), 12)
        (segment,) = store.segments(Path(tmp) / "rank0", "full")
        return segment.read_bytes()


BASE = _base()

hostile_batches = st.sampled_from(
    [
        msgspec.structs.replace(batch(3), wall_offset=NAN),
        msgspec.structs.replace(batch(3), time=INF),
        msgspec.structs.replace(batch(3), time=-1e300),
        msgspec.structs.replace(batch(11), time=9e14),  # finite, in range, past any calendar
        msgspec.structs.replace(batch(11), time=-9e14, wall_offset=-9e14),
        msgspec.structs.replace(batch(11), log=[wire.LogChunk(11, 2**62, [2**62, 2**62 + 1], True)]),
        msgspec.structs.replace(batch(3), telemetry=wire.Telemetry(time=NAN)),
        msgspec.structs.replace(batch(3), v=wire.PROTOCOL_VERSION + 7),
        msgspec.structs.replace(batch(3), log=[wire.LogChunk(5, 2**62, [2**63 - 1, (7, NAN)], False)]),
        msgspec.structs.replace(batch(3), log=[wire.LogChunk(-5, -1, [-(2**63), 1.5, "x", None], True)]),  # type: ignore[list-item]
        msgspec.structs.replace(hello(), start_time=NAN),
        msgspec.structs.replace(hello(), run_id="другой"),
    ]
)
raw_payloads = st.one_of(
    hostile_batches.map(wire.encode),
    st.binary(max_size=64),
    st.recursive(
        st.none() | st.booleans() | st.floats() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
        max_leaves=20,
    ).map(msgspec.msgpack.encode),
    st.just(msgspec.msgpack.encode({"type": "batch", "v": wire.PROTOCOL_VERSION, "log": [[0] * 3] * 2})),
    st.just(b"\x91" * 2000 + b"\xc0"),  # nesting deeper than msgspec goes
)


@st.composite
def mutations(draw: st.DrawFn) -> bytes:
    data = bytearray(BASE)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["cut", "flip", "overwrite", "storm", "huge", "frame", "header"]))
        at = draw(st.integers(0, len(data)))
        if kind == "cut":
            del data[at:]
        elif kind == "flip" and data:
            k = min(at, len(data) - 1)
            data[k] ^= 1 << draw(st.integers(0, 7))
        elif kind == "overwrite":
            data[at : at + 16] = draw(st.binary(min_size=1, max_size=32))
        elif kind == "storm":
            length = draw(st.sampled_from([0, 12, 4096, 1 << 20, wire.MAX_FRAME_BYTES, 2**32 - 1]))
            word = rec.SYNC + length.to_bytes(4, "little") + draw(st.binary(min_size=4, max_size=4))
            data[at:at] = word * draw(st.integers(1, 2000))
        elif kind == "huge":
            data[at:at] = rec.SYNC + draw(st.integers(0, 2**32 - 1)).to_bytes(4, "little") + bytes(4)
        elif kind == "frame":
            data[at:at] = rec.frame(draw(raw_payloads))
        else:
            data[8:12] = draw(st.binary(min_size=4, max_size=4))
    return bytes(data)


def _readers(path: Path, tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (
        ["report", str(path), "--history"],
        ["report", str(path), "--seconds", "0.5"],
        ["compare", str(path), str(path), "--json"],
        ["trace", str(path), "-o", str(tmp / "t.json")],
    ):
        code = main(argv)
        err = capsys.readouterr().err
        assert "Traceback" not in err
        lines = err.strip().splitlines()
        assert all(line.startswith("torchtop") for line in lines), lines
        if code != 0:
            assert code == 2 and len(lines) == 1, (argv, code, lines)
    try:
        pb, _ = load(path)
    except rec.RecordingError:
        return
    # the replay's walk: seek to the middle, play on
    state = pb.state_until(pb.start + (pb.end - pb.start) / 2)
    for p in pb.play(pb.index_at(pb.start + (pb.end - pb.start) / 2)):
        for s in p.steps:
            assert math.isfinite(s.t0) and s.wall_ns >= 0
    assert state is not None


@seed(26)
@FUZZ
@given(data=mutations())
def test_every_reader_survives_a_damaged_recording(
    data: bytes, tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    tmp = tmp_path_factory.mktemp("fuzz")
    segment = tmp / "rank0" / "full-000000.ttrec"
    segment.parent.mkdir()
    segment.write_bytes(data)
    _readers(tmp, tmp, capsys)
    _readers(segment, tmp, capsys)  # a segment file given on its own


def test_the_fuzzer_s_base_is_a_whole_recording() -> None:
    assert BASE.startswith(rec.header()[:12]) and BASE.endswith(rec.frame(rec.END))
