"""The host pool shared between vLLM's worker process and its scheduler process.

vLLM builds the worker's KV caches before it constructs the scheduler, so the worker
creates the pool (it owns the bytes it copies) and the scheduler attaches to it by name
(it owns the index and the lower-tier I/O). The name is derived from the engine id and
TP rank, which both processes read from the same ``VllmConfig``.

Invariants:

* The creator sizes the file once and touches every page before anyone uses it.
* The attacher checks the size it expects against the file; a mismatch (two processes
  that disagree on the geometry) is an error, never a silent misread.
* The attacher unlinks the name once mapped, so nothing leaks in ``/dev/shm`` after a
  crash; the creator unlinks too (ignoring ENOENT) at shutdown.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from pathlib import Path

from kvtier.sizes import format_size
from kvtier.tiers.base import TierError

SHM_DIR = Path(os.environ.get("KVTIER_SHM_DIR", "/dev/shm"))


def pool_path(engine_id: str, tp_rank: int) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in engine_id)
    return SHM_DIR / f"kvtier-{safe}-rank{tp_rank}"


def create_pool(path: Path, nbytes: int) -> mmap.mmap:
    """Create, size and pre-fault a shared pool file of ``nbytes``."""
    st = os.statvfs(path.parent)
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise TierError(
            f"tiers[0].host.capacity: a {format_size(nbytes)} shared host pool does not fit "
            f"in {path.parent} ({format_size(free)} free); lower the capacity or enlarge "
            f"{path.parent}"
        )
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)
    return mm


def attach_pool(path: Path, nbytes: int) -> mmap.mmap:
    """Map an existing pool of exactly ``nbytes`` and unlink its name."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        raise TierError(
            f"kvtier: the worker's host pool {path} does not exist; the worker side of the "
            "connector did not start (is kv_role kv_both and the same kv_transfer_config "
            "used by every process?)"
        ) from None
    try:
        size = os.fstat(fd).st_size
        if size != nbytes:
            raise TierError(
                f"kvtier: host pool {path} is {size} bytes, the scheduler expects {nbytes}; "
                "the worker and scheduler disagree on the KV geometry"
            )
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    remove_pool(path)
    return mm


def remove_pool(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
