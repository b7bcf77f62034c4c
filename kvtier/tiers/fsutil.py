"""Filesystem helpers of the file tier: opens that cannot block or follow, exact modes,
whole reads and writes, the walk of the object tree.

Invariants:

* An object is only read through ``open_regular``: it never follows a symlink and never
  blocks on a FIFO or a device (``O_NOFOLLOW | O_NONBLOCK``), and anything but a regular
  file is refused with ``NotRegular`` before a byte is read. ``O_NOFOLLOW`` covers the
  last component only: callers reach the file's directory with ``open_dir``, one level at
  a time relative to the last (``dir_fd``), so no directory on the way is a symlink.
* What kvtier creates gets exactly the configured mode, whatever the umask: files are
  ``fchmod``-ed before they are published (``link``/``rename``), a new directory is
  ``chmod``-ed when the umask took bits away (keeping a set-group-id bit it inherited).
* Nothing here creates a directory's parents implicitly; the caller names every level.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator

_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: For files kvtier creates: a symlink planted at the (random) temp name is not followed.
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class NotRegular(OSError):
    """The path names a symlink, FIFO, socket, device or directory, not a regular file."""


def dir_mode(file_mode: int) -> int:
    """The mode of directories holding files of ``file_mode``: search (x) wherever read is
    allowed, e.g. 0600 -> 0700, 0640 -> 0750, 0660 -> 0770."""
    return file_mode | ((file_mode & 0o444) >> 2)


def open_dir(path: str | os.PathLike[str], *, dir_fd: int | None = None) -> int:
    """A descriptor of the directory at ``path`` (relative to ``dir_fd`` if given), never
    through a symlink at its last component (the caller closes it). Raises
    ``FileNotFoundError`` if absent, ``NotRegular`` if it is a symlink or not a directory."""
    try:
        return os.open(path, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise NotRegular(e.errno, "symbolic link or not a directory",
                             os.fspath(path)) from None
        raise


def open_regular(path: str | os.PathLike[str], *, dir_fd: int | None = None) -> int:
    """A read-only descriptor of the regular file at ``path`` (relative to ``dir_fd`` if
    given; the caller closes it).

    Raises ``FileNotFoundError`` if absent, ``NotRegular`` if it is anything else than a
    regular file (a symlink included), another ``OSError`` on I/O faults.
    """
    try:
        fd = os.open(path, _READ_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink
            raise NotRegular(errno.ELOOP, "symbolic link", os.fspath(path)) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotRegular(errno.EINVAL, f"not a regular file (type {stat.S_IFMT(mode):o})",
                         os.fspath(path))
    os.set_blocking(fd, True)  # O_NONBLOCK was for the open; reads of a file may block
    return fd


def write_all(fd: int, parts: list[memoryview]) -> None:
    """Write every byte of ``parts``; short writes are continued, never ignored."""
    pending = [p for p in parts if p.nbytes]
    while pending:
        n = os.writev(fd, pending)
        while n and pending:
            if n >= pending[0].nbytes:
                n -= pending[0].nbytes
                pending.pop(0)
            else:
                pending[0] = pending[0][n:]
                n = 0


def read_exact(fd: int, dst: memoryview) -> int:
    """Read into ``dst`` until it is full or the file ends; returns the bytes read."""
    got = 0
    while got < dst.nbytes:
        n = os.readv(fd, [dst[got:]])
        if n == 0:
            break
        got += n
    return got


def walk_leaves(top: str | os.PathLike[str]) -> Iterator[os.DirEntry[str]]:
    """Entries of ``top/xx/yy/`` (the object tree's leaf directories), and the files in
    ``top`` itself (probes). Symlinked directories are not followed."""
    for d1 in os.scandir(top):
        if not d1.is_dir(follow_symlinks=False):
            yield d1
            continue
        if len(d1.name) != 2:
            continue
        for d2 in os.scandir(d1.path):
            if d2.is_dir(follow_symlinks=False) and len(d2.name) == 2:
                yield from os.scandir(d2.path)


def is_regular(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode)


def make_dir(path: str | os.PathLike[str], mode: int, *, dir_fd: int | None = None) -> bool:
    """Create one directory with exactly ``mode`` (``path`` relative to ``dir_fd`` if
    given); ``False`` if something is already there (another node may create it at the
    same time). Its parent must exist."""
    try:
        os.mkdir(path, mode, dir_fd=dir_fd)
    except FileExistsError:
        return False
    st = os.lstat(path, dir_fd=dir_fd)
    if st.st_mode & 0o777 != mode:  # the umask took bits away
        os.chmod(path, mode | (st.st_mode & stat.S_ISGID), dir_fd=dir_fd)
    return True


def set_mode(fd: int, st: os.stat_result, mode: int) -> None:
    """Give the open file ``mode`` unless it has it already (no metadata write then)."""
    if st.st_mode & 0o7777 != mode:
        os.fchmod(fd, mode)
