"""Directories only this user can write, and files in them nobody else can redirect.

Every directory torchtop creates or writes into on a shared machine (the runtime directory with
its discovery files and sockets, the capture directory, the monitor's ssh socket directory) goes
through here. The rules: look at the last component with lstat (a symlink planted by another
user is refused, never followed), open it with O_NOFOLLOW, check owner and mode on that open
descriptor, and change the mode only through it (never chmod a path that was not verified).
Files are created with O_CREAT|O_EXCL|O_NOFOLLOW. Stdlib only: the monitor uses it too.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

UNIX_PATH_MAX = 107  # sun_path is 108 bytes with its NUL (Linux); ZeroMQ's ipc:// limit too
SHORT_BASE = "/tmp"


class NotPrivate(PermissionError):
    """A path another user owns, can write, or points elsewhere with a symlink; says which and why."""


def _uid() -> int | None:
    return os.geteuid() if hasattr(os, "geteuid") else None


def open_private_dir(
    path: Path, *, create: bool = True, narrow: bool = False, own_symlink: bool = True
) -> int:
    """An O_DIRECTORY descriptor of `path`, once verified to be a directory of this user that no
    one else can write into. Created 0700 when missing (with `create`; parents as needed).

    narrow: a directory of ours with group/other bits loses them (fchmod on the verified
    descriptor); else one that others can write is refused. own_symlink: a symlink that we own
    is followed (its target is then checked the same way); another user's is always refused.
    Raises NotPrivate, or OSError when the path cannot be made or opened.
    """
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    uid = _uid()
    st = os.lstat(path)
    follow = False
    if stat.S_ISLNK(st.st_mode):
        if uid is not None and st.st_uid != uid:
            raise NotPrivate(f"{path} is a symlink owned by another user (uid {st.st_uid}); refusing it")
        if not own_symlink:
            raise NotPrivate(f"{path} is a symlink; refusing it (name the real directory)")
        follow = True
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags if follow else flags | getattr(os, "O_NOFOLLOW", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode):
            raise NotPrivate(f"{path} is not a directory")
        if uid is not None and st.st_uid != uid:
            raise NotPrivate(f"{path} belongs to another user (uid {st.st_uid})")
        if narrow and st.st_mode & 0o077:
            os.fchmod(fd, stat.S_IMODE(st.st_mode) & 0o700)  # drop group/other, keep what the owner had
        elif not narrow and st.st_mode & 0o022:
            raise NotPrivate(f"{path} can be written by other users (mode {stat.S_IMODE(st.st_mode):o})")
    except BaseException:  # broad: closes the descriptor on any exit, then re-raises
        os.close(fd)
        raise
    return fd


def check_private_dir(
    path: Path, *, create: bool = True, narrow: bool = False, own_symlink: bool = True
) -> None:
    """open_private_dir, for its checks only."""
    os.close(open_private_dir(path, create=create, narrow=narrow, own_symlink=own_symlink))


def create_file(dir_fd: int, name: str, mode: int = 0o600) -> int:
    """A new file `name` in the verified directory, opened for writing; FileExistsError if the
    name is taken by anything at all (a file, a symlink to anywhere): never reuse, never follow."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    return os.open(name, flags, mode, dir_fd=dir_fd)


def fd_dir(dir_fd: int, fallback: Path) -> str:
    """A path to the directory open as `dir_fd` that stays on it even if an ancestor is swapped
    meanwhile (/proc/self/fd on Linux); else `fallback`."""
    proc = f"/proc/self/fd/{dir_fd}"
    return proc if os.path.isdir(proc) else str(fallback)


def fits_socket(path: Path, longest_name: int) -> bool:
    """Whether a Unix socket named up to `longest_name` characters fits in `path`."""
    return len(os.fsencode(str(path))) + 1 + longest_name <= UNIX_PATH_MAX


def short_private_tempdir(prefix: str) -> Path:
    """A fresh 0700 directory (mkdtemp: ours, created exclusively) with a path short enough for
    Unix sockets: in the temp dir when its path is short, else in /tmp."""
    base = tempfile.gettempdir()
    if len(base) > 40:
        base = SHORT_BASE
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))
