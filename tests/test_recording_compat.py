"""Recordings have their own compatibility rule (issue 27): a recording names its format and its
wire protocol; this torchtop reads those of this protocol and the one before (checked-in
recordings of each, tests/fixtures/recordings/make.py says how they were made), and refuses a
newer one saying which version to install."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from torchtop.contract import recording as rec
from torchtop.contract import wire
from torchtop.monitor.commands.cli import main
from torchtop.monitor.model.playback import load

FIXTURES = Path(__file__).parent / "fixtures" / "recordings"
CURRENT = FIXTURES / "wire5-format2"
PREVIOUS = FIXTURES / "wire4-format1"


def steps(path: Path) -> list[tuple[int, dict[str, int]]]:
    pb, _ = load(path)
    return [(s.i, dict(s.phases)) for p in pb.play() for s in p.steps]


def test_the_fixtures_are_the_current_and_the_previous_wire_protocol() -> None:
    from torchtop.contract import recording_compat

    assert rec.READ_PROTOCOLS == (wire.PROTOCOL_VERSION - 1, wire.PROTOCOL_VERSION)
    assert set(recording_compat.UPGRADES) | {wire.PROTOCOL_VERSION} == set(rec.READ_PROTOCOLS)
    for path, (fmt, protocol) in ((CURRENT, (rec.FORMAT_VERSION, 5)), (PREVIOUS, (1, 4))):
        segment = path / "rank0" / "full-000000.ttrec"
        header = rec.check_header(segment.read_bytes()[: rec.HEADER_BYTES], str(segment))
        assert (header.format, header.protocol) == (fmt, protocol)
    # a new protocol needs new fixtures: this test names the pair it holds
    assert wire.PROTOCOL_VERSION == 5, "make the fixtures again (tests/fixtures/recordings/make.py)"


def test_both_read_to_the_same_steps_and_hello() -> None:
    current, previous = steps(CURRENT), steps(PREVIOUS)
    assert len(current) == 40 and previous == current
    # wire 4's GRAD code (5) is read as a backward, not as protocol 5's code 5 (comm)
    assert all(p["backward"] > 0 and p["comm"] == 0 for _, p in previous)
    pb, _ = load(PREVIOUS)
    assert pb.hello is not None and pb.hello.cuda_event_every == 4 and pb.hello.v == wire.PROTOCOL_VERSION
    assert pb.warnings == []


@pytest.mark.parametrize("path", [CURRENT, PREVIOUS], ids=["wire5", "wire4"])
def test_report_reads_both(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(path), "--history"]) == 0
    out = capsys.readouterr()
    assert '"steps"' in out.out and "Traceback" not in out.err


def _with_header(tmp_path: Path, fmt: int, protocol: int, writer: int) -> Path:
    data = bytearray((CURRENT / "rank0" / "full-000000.ttrec").read_bytes())
    data[: rec.HEADER_BYTES] = struct.pack("<8sHHI", rec.MAGIC, fmt, protocol, writer)
    out = tmp_path / "rank0" / "full-000000.ttrec"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(bytes(data))
    return tmp_path


def test_a_newer_recording_says_which_version_to_install(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _with_header(tmp_path, rec.FORMAT_VERSION + 1, 9, rec.pack_version("0.4.2"))
    assert main(["report", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "recording format 3" in err[0] and "install torchtop>=0.4.2" in err[0], err
    # a known format of a newer wire protocol: the same advice
    path = _with_header(
        tmp_path / "b", rec.FORMAT_VERSION, wire.PROTOCOL_VERSION + 1, rec.pack_version("0.3.0")
    )
    with pytest.raises(rec.RecordingError, match=r"wire protocol 6 .*install torchtop>=0.3.0"):
        load(path)


def test_an_older_protocol_than_the_last_two_says_which_torchtop_reads_it(tmp_path: Path) -> None:
    path = _with_header(tmp_path, 2, wire.PROTOCOL_VERSION - 2, rec.pack_version("0.0.9"))
    with pytest.raises(rec.RecordingError, match=r"wire protocol 3 .*open it with torchtop 0.0.9"):
        load(path)


def test_the_version_packs_and_unpacks() -> None:
    assert rec.unpack_version(rec.pack_version("1.2.3")) == "1.2.3"
    assert rec.pack_version("dev") == 0 and rec.unpack_version(0) == ""
