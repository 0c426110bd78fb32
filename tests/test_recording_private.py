"""Recordings are private like captures (issue 26, docs/security.md promise 4): 0700 directories,
0600 segments, nothing written through another user's link or into their directory, the user
told where the recording went instead. The other user is simulated as `nobody` (as root: a
planted link is lchown'ed to them, a read is tried under setpriv); without root those skip."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.recording_util import batch, hello, write
from torchtop.agent.loop.recorder import Recorder
from torchtop.contract import recording_store as store
from torchtop.monitor.model.playback import load

NOBODY = 65534
SETPRIV = shutil.which("setpriv")
as_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0,
    reason="planting another user's files needs root (lchown); run the tests as root",
)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@pytest.fixture
def shared(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A world-traversable directory with a umask that would leave files readable by all; the
    runtime directory is its `rt`."""
    base = Path(tempfile.mkdtemp(prefix="torchtop-rec-", dir="/tmp"))
    os.chmod(base, 0o755)
    monkeypatch.setenv("TORCHTOP_RUNTIME_DIR", str(base / "rt"))
    old = os.umask(0o022)
    try:
        yield base
    finally:
        os.umask(old)
        shutil.rmtree(base, ignore_errors=True)


def steps(path: Path) -> int:
    pb, _ = load(path)
    return sum(len(p.steps) for p in pb.play())


def test_a_recording_is_0700_directories_and_0600_segments(shared: Path) -> None:
    path = shared / "runs" / "a"
    write(path, 5)
    assert mode(path) == 0o700 and mode(path / "rank0") == 0o700
    segments = list((path / "rank0").iterdir())
    assert segments and all(mode(p) == 0o600 for p in segments), [(p.name, oct(mode(p))) for p in segments]


def test_a_rank_directory_of_ours_is_narrowed(shared: Path) -> None:
    path = shared / "mine"
    (path / "rank0").mkdir(parents=True)
    os.chmod(path / "rank0", 0o755)
    write(path, 3)
    assert mode(path / "rank0") == 0o700 and steps(path) == 30


def test_a_segment_past_999999_is_still_read(shared: Path) -> None:
    """A full-999999 left in the directory: the writer's next name is still one readers read."""
    path = shared / "old"
    (path / "rank0").mkdir(parents=True)
    (path / "rank0" / "full-999999.ttrec").write_bytes(b"")
    write(path, 4)
    full = [p.name for p in store.segments(path / "rank0", "full")]
    assert full == ["full-999999.ttrec", "full-1000000.ttrec"], full
    pb, _ = load(path)
    assert sum(len(p.steps) for p in pb.play()) == 40


def _plant_link(target: Path, link: Path) -> None:
    os.symlink(target, link)
    os.lchown(link, NOBODY, NOBODY)


def _fallback(shared: Path, name: str) -> Path:
    found = list((shared / "rt" / "recordings").glob(f"{name}-*"))
    assert len(found) == 1, found
    return found[0]


@as_root
def test_another_users_symlink_as_the_path_is_refused_and_the_user_told(
    shared: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    victim = shared / "victim"
    victim.mkdir(mode=0o700)
    link = shared / "rec"
    _plant_link(victim, link)
    recorder = Recorder(link, 0)
    recorder.start()
    recorder.put(hello())
    recorder.put(batch(0))
    recorder.close()
    assert list(victim.iterdir()) == []  # nothing written through their link
    err = capfd.readouterr().err.strip().splitlines()
    fallback = _fallback(shared, "rec")
    assert recorder.directory == fallback / "rank0" and mode(fallback / "rank0") == 0o700
    assert len(err) == 1 and str(fallback / "rank0") in err[0] and "another user" in err[0], err
    assert steps(fallback) == 10


@as_root
def test_another_users_rank_link_in_a_writable_directory_is_refused(shared: Path) -> None:
    path = shared / "open"
    path.mkdir()
    os.chmod(path, 0o777)  # a directory others can write (a shared project directory)
    victim = shared / "victim"
    victim.mkdir(mode=0o700)
    _plant_link(victim, path / "rank0")
    writer = store.RecordingWriter(path, 0)
    writer.write(hello())
    writer.close()
    assert list(victim.iterdir()) == [] and "can be written by other users" in writer.note
    assert writer.directory.parent == _fallback(shared, "open")


@as_root
def test_another_users_directory_with_a_planted_segment_is_not_used(shared: Path) -> None:
    """Their directory, their full-999999: the recording goes to a private place, readable."""
    theirs = shared / "theirs"
    (theirs / "rank0").mkdir(parents=True)
    (theirs / "rank0" / "full-999999.ttrec").write_bytes(b"planted")
    for p in (theirs, theirs / "rank0", theirs / "rank0" / "full-999999.ttrec"):
        os.lchown(p, NOBODY, NOBODY)
    writer = store.RecordingWriter(theirs, 0)
    writer.write(hello())
    for k in range(3):
        writer.write(batch(k))
    writer.close()
    assert sorted(p.name for p in (theirs / "rank0").iterdir()) == ["full-999999.ttrec"]
    assert "belongs to another user" in writer.note
    assert steps(writer.directory.parent) == 30


READ = r"""
import sys
try:
    open(sys.argv[1], "rb").read(1); print("read")
except PermissionError:
    print("denied")
"""


@as_root
@pytest.mark.skipif(SETPRIV is None, reason="needs setpriv (util-linux)")
def test_another_user_cannot_read_a_recording(shared: Path) -> None:
    path = shared / "r"
    write(path, 2)
    segment = next((path / "rank0").iterdir())
    os.chmod(path, 0o755)  # even with the top directory opened up, the segment is the user's
    os.chmod(path / "rank0", 0o755)
    assert SETPRIV is not None
    cmd = [
        SETPRIV,
        "--reuid=nobody",
        "--regid=nogroup",
        "--clear-groups",
        sys.executable,
        "-c",
        READ,
        str(segment),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd="/", timeout=60)
    assert out.stdout.strip() == "denied", out
