"""Capture files: where they may go and how they are written, so no one else can redirect them.

A capture file goes only into a directory the training user owns and nobody else can write:
$TORCHTOP_DIR, else ./torchtop-captures (created 0700). One that exists but is another user's,
writable by others, or a symlink is refused, and files go to <runtime dir>/captures instead,
with a note saying where and why (warned once on stderr, and in every such capture's
CaptureInfo). Each file is created 0600 with O_CREAT|O_EXCL|O_NOFOLLOW in the directory
opened and verified as a descriptor, under a new name when the usual one is taken: nothing is
ever overwritten, nor written through a link. torch.profiler's export opens its path itself
(following links), so it writes into a fresh 0700 temp directory inside the verified one, and
the file is then linked into place under a free name (link(2) never replaces) or copied into
an exclusively created file.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from torchtop.contract import discovery
from torchtop.contract.private import NotPrivate, create_file, fd_dir, open_private_dir

T = TypeVar("T")
NAME_TRIES = 20


class CaptureDirError(OSError):
    """No directory to write captures into; the message says why and what to do."""


def wanted_dir() -> Path:
    """$TORCHTOP_DIR, else ./torchtop-captures; absolute but unresolved (a planted link is seen)."""
    return Path(os.path.abspath(os.environ.get("TORCHTOP_DIR") or "torchtop-captures"))


def fallback_dir() -> Path:
    return discovery.runtime_dir() / "captures"


@dataclass
class Destination:
    """A verified capture directory, held open: files are created relative to `fd`."""

    path: Path
    fd: int
    note: str = ""  # why files go here and not where asked ("" when they go where asked)

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


def open_destination(wanted: Path) -> Destination:
    """`wanted` if it is private to this user, else the fallback with a note; CaptureDirError if
    neither can be used."""
    try:
        return Destination(wanted, open_private_dir(wanted, create=True, own_symlink=False))
    except NotPrivate as exc:
        reason = str(exc)
    except OSError as exc:
        reason = f"cannot use {wanted}: {exc.strerror or exc}"
    fallback = fallback_dir()
    try:
        os.close(discovery.open_runtime_dir())  # the runtime directory itself: ours, 0700
        fd = open_private_dir(fallback, create=True, narrow=True)
    except OSError as exc:
        raise CaptureDirError(
            f"cannot write captures: {reason}; nor to {fallback} ({exc}); "
            "set TORCHTOP_DIR to a directory of yours that only you can write"
        ) from None
    note = (
        f"capture files go to {fallback}: {reason}; set TORCHTOP_DIR to a directory of yours "
        "that only you can write"
    )
    return Destination(fallback, fd, note)


def _name(stem: str, suffix: str, attempt: int) -> str:
    return f"{stem}{suffix}" if attempt == 0 else f"{stem}-{secrets.token_hex(4)}{suffix}"


def create(dest: Destination, stem: str, suffix: str) -> tuple[Path, int]:
    """A new 0600 file in `dest`, open for writing: its path and descriptor."""
    for attempt in range(NAME_TRIES):
        name = _name(stem, suffix, attempt)
        try:
            return dest.path / name, create_file(dest.fd, name)
        except FileExistsError:
            continue  # taken (maybe by a planted link): another name, never that one
    raise FileExistsError(errno.EEXIST, f"no free file name for {stem}{suffix} in {dest.path}")


def _place(dest: Destination, src: str, stem: str, suffix: str) -> Path:
    """Link `src` into `dest` under a free name (link never replaces); copy where links fail."""
    for attempt in range(NAME_TRIES):
        name = _name(stem, suffix, attempt)
        try:
            os.link(src, name, dst_dir_fd=dest.fd, follow_symlinks=False)
            return dest.path / name
        except FileExistsError:
            continue
        except OSError:  # a filesystem without hard links: copy into a file we create
            break
    path, fd = create(dest, stem, suffix)
    with open(src, "rb") as fin, os.fdopen(fd, "wb") as fout:
        shutil.copyfileobj(fin, fout)
    return path


def export(
    dest: Destination, stem: str, suffix: str, write: Callable[[str], None], read: Callable[[str], T]
) -> tuple[Path, T]:
    """`write(path)` a file that something else opens by path (torch's exporter), `read(path)` it
    back, and put it in `dest` under a free name, 0600: (its path, what `read` returned)."""
    tmp = tempfile.mkdtemp(prefix=".torchtop-", dir=fd_dir(dest.fd, dest.path))  # 0700, ours
    try:
        inner = os.path.join(tmp, "export" + suffix)
        write(inner)
        os.chmod(inner, 0o600)  # in our private temp directory: nothing else could have put a link
        result = read(inner)
        return _place(dest, inner, stem, suffix), result
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
