"""Host memory: how much there is, how to get it, how to share it, how to page-lock it.

The one module for raw host memory. ``kvtier.tiers.pool`` (slots over it),
``kvtier.ops`` (pinned staging buffers) and ``kvtier.vllm.shm`` (the pool shared by
vLLM's worker and scheduler processes) all build on it, so none of them imports another
for memory. It is a leaf: it imports nothing from kvtier but ``kvtier.sizes``, and torch
only inside ``register_pinned`` (page-locking needs CUDA; nothing else here does).

Invariants:

* Every buffer handed out is page-aligned and has every page faulted in before it is
  returned (``MAP_POPULATE``, or a write to each page where that flag is missing), so
  first use never page-faults on a copy path.
* A request that cannot be met fails here, at allocation, with the numbers and the
  ``setting`` to change (``HostMemoryError``); never later, on first touch.
* A shared file is created at its full size, or not at all (a failed create unlinks it);
  an attach maps exactly the size it expects, or fails naming both sizes.
* A shared file is only ever a new one: created with ``O_CREAT | O_EXCL | O_NOFOLLOW``,
  so an existing file (a second engine under the same name, a crash's leftover) or a
  planted symlink is an error naming the path and what to do (``SharedFileExists``),
  never truncated, followed or shared. An attach opens with ``O_NOFOLLOW`` too, maps only
  a regular file, and unlinks the name only while it still names the file it mapped.
* ``register_pinned`` never pins silently halfway: it returns False (nothing done) where
  page-locking is impossible, raises with the size when the driver refuses, and ties the
  unregistration to the lifetime of the memory's owner.

Thread safety: every function may be called from any thread; none keeps state.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import stat
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.sizes import format_size

log = logging.getLogger("kvtier.hostmem")

if TYPE_CHECKING:
    import torch

#: Why ``pinned: yes`` failed: raised at start rather than silently pageable.
PINNED_UNAVAILABLE = (
    "tiers[0].host.pinned: yes, but the host pool cannot be page-locked here (no CUDA "
    "device, or the native extension is missing); use pinned: auto (page-locked when "
    "possible) or no"
)

#: ``allocator(nbytes) -> (buffer, is_pinned)``. The buffer must be page-aligned and
#: support the buffer protocol (``mmap.mmap``, a numpy array, ...).
Allocator = Callable[[int], tuple[Any, bool]]

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class HostMemoryError(Exception):
    """Host memory could not be had. The message gives the numbers and what to change."""


class SharedFileExists(HostMemoryError):
    """The shared file's name is taken (a file, or a symlink that is not followed)."""


_CREATE = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_ATTACH = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC


def _exists_message(path: Path) -> str:
    try:
        what = "a symbolic link (never followed)" if path.is_symlink() else "a file"
    except OSError:
        what = "something"
    return (
        f"shared host pool {path}: {what} of that name already exists, and kvtier only "
        "uses a file it creates itself. Either another engine runs with the same "
        "kv_transfer_config.engine_id (give each engine its own engine_id, or leave it "
        "unset so vLLM picks a unique one), or an engine that crashed left it behind: if "
        f"no process has it open (`fuser -v {path}` prints nothing), remove it with "
        f"`rm {path}` and start again"
    )


def mem_available() -> int | None:
    """MemAvailable from /proc/meminfo in bytes, or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def touch_pages(buf: Any) -> None:
    """Fault in every page of the writable buffer ``buf`` now (writes zeros)."""
    arr = np.frombuffer(buf, dtype=np.uint8)
    arr[:: mmap.PAGESIZE] = 0


def anonymous(nbytes: int) -> mmap.mmap:
    """``nbytes`` of private, anonymous, page-aligned, pre-faulted memory. Not pinned."""
    if nbytes <= 0:
        raise ValueError(f"host memory: nbytes must be > 0, got {nbytes}")
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)
    if not _POPULATE:
        touch_pages(mm)
    return mm


def mmap_allocator(nbytes: int) -> tuple[Any, bool]:
    """The ``Allocator`` of pageable memory: ``(anonymous(nbytes), False)``."""
    return anonymous(nbytes), False


def create_shared(path: Path, nbytes: int, *, setting: str) -> mmap.mmap:
    """Create the new file ``path`` (owner-only), size it to ``nbytes``, map it shared and
    pre-fault it. ``SharedFileExists`` if the name is taken (a symlink included: it is not
    followed); ``HostMemoryError`` naming ``setting`` if the file system cannot hold it."""
    if nbytes <= 0:
        raise ValueError(f"host memory: nbytes must be > 0, got {nbytes}")
    st = os.statvfs(path.parent)
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise HostMemoryError(
            f"{setting}: a {format_size(nbytes)} shared host pool does not fit in "
            f"{path.parent} ({format_size(free)} free); lower the capacity or enlarge {path.parent}"
        )
    try:
        fd = os.open(path, _CREATE, 0o600)
    except FileExistsError:
        if not _remove_if_stale(path, nbytes):
            raise SharedFileExists(_exists_message(path)) from None
        try:
            fd = os.open(path, _CREATE, 0o600)
        except FileExistsError:
            raise SharedFileExists(_exists_message(path)) from None
    try:
        # Held for the creator's life: a file whose lock nobody holds was left by a
        # creator that died (e.g. in vLLM's warm-up, before the scheduler attached).
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _POPULATE)
    except BaseException:
        os.close(fd)
        remove_shared(path)
        raise
    _creator_locks[str(path)] = fd
    if not _POPULATE:
        touch_pages(mm)
    return mm


def attach_shared(path: Path, nbytes: int, *, unlink: bool = True) -> mmap.mmap:
    """Map the existing file ``path`` of exactly ``nbytes`` shared; then, with ``unlink``,
    remove its name (the mapping keeps the memory; nothing is left behind after a crash).

    ``FileNotFoundError`` if it does not exist; ``HostMemoryError`` naming both sizes if
    it is not ``nbytes`` long (its creator disagrees on the geometry). Does not touch
    the pages: its creator did.
    """
    try:
        fd = os.open(path, _ATTACH)
    except OSError as e:
        if e.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink
            raise HostMemoryError(
                f"host pool {path} is a symbolic link; kvtier never follows one (remove it)"
            ) from None
        raise
    try:
        st = os.fstat(fd)
        size = st.st_size
        if not stat.S_ISREG(st.st_mode):
            raise HostMemoryError(f"host pool {path} is not a regular file (remove it)")
        if size != nbytes:
            raise HostMemoryError(
                f"host pool {path} is {size} bytes, this process expects {nbytes}; its "
                "creator uses another geometry or capacity"
            )
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    if unlink:
        with contextlib.suppress(FileNotFoundError):
            now = os.stat(path, follow_symlinks=False)
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                path.unlink()
    return mm


def _remove_if_stale(path: Path, nbytes: int) -> bool:
    """Unlink ``path`` if it is a pool a dead creator left: a regular file of this user,
    exactly ``nbytes`` long, that no live creator holds (a creator's ``flock`` goes with
    its process). True if it was removed; anything else is left alone. Local
    ``/dev/shm`` only: ``flock`` is never used on shared storage."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False  # a symlink (ELOOP), gone meanwhile, or not ours to open
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size != nbytes:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its creator is alive: another engine with this engine_id
        try:
            now = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            return True
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return False
        log.warning("kvtier: removing %s, a shared host pool left by an engine that "
                    "exited before its scheduler attached", path)
        path.unlink()
        return True
    finally:
        os.close(fd)


#: path -> fd of each pool this process created, kept open (and locked) until removed
_creator_locks: dict[str, int] = {}


def remove_shared(path: Path) -> None:
    """Unlink a shared pool's name; a name already gone is fine. The creator's lock on
    it is released."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    fd = _creator_locks.pop(str(path), None)
    if fd is not None:
        os.close(fd)


def register_pinned(buf: torch.Tensor | Any, *, owner: object) -> bool:
    """Page-lock existing host memory (a torch CPU tensor or any writable buffer, e.g. a
    shared mapping) for CUDA DMA, when CUDA is available.

    Returns False (nothing done) without torch or CUDA; raises ``RuntimeError`` with the
    size when registration fails. The registration is dropped when ``owner`` (what keeps
    the memory alive) is freed.
    """
    try:
        import torch
    except ImportError:
        return False
    if not torch.cuda.is_available():
        return False
    if isinstance(buf, torch.Tensor):
        ptr, nbytes = buf.data_ptr(), buf.numel() * buf.element_size()
    else:
        arr = np.frombuffer(buf, dtype=np.uint8)
        ptr, nbytes = int(arr.ctypes.data), arr.nbytes
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    flags = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped
    err = int(cudart.cudaHostRegister(ptr, nbytes, flags))
    if err != 0:
        raise RuntimeError(
            f"alloc_pinned: cannot pin {nbytes / 2**30:.1f} GiB of host memory: "
            f"cudaHostRegister failed with error {err} (check `ulimit -l`)"
        )
    weakref.finalize(owner, cudart.cudaHostUnregister, ptr)
    return True
