"""The host pool shared between vLLM's worker process and its scheduler process.

vLLM builds the worker's KV caches before it constructs the scheduler, so the worker
creates the pool (it owns the bytes it copies) and the scheduler attaches to it by name
(it owns the index and the lower-tier I/O). The name is derived from the engine id and
TP rank, which both processes read from the same ``VllmConfig``. Both sides hold it as
a ``HostPool`` of the same ``slot_bytes`` and ``num_slots`` (``HostPool.slots_for`` of the
same capacity): the worker's from ``HostPool.create_shm``, the scheduler's from
``attach_host_pool``. The memory itself is ``kvtier.hostmem``'s.

Invariants:

* The creator sizes the file once and touches every page before anyone uses it.
* The attacher checks the size it expects against the file; a mismatch (two processes
  that disagree on the geometry) is an error, never a silent misread.
* The attacher unlinks the name once mapped, so nothing leaks in ``/dev/shm`` after a
  crash; the creator unlinks too (``remove_pool``, ignoring ENOENT) at shutdown.

Thread safety: stateless; call from the thread that builds or closes a side.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvtier.hostmem import remove_shared as remove_pool
from kvtier.tiers.base import TierError
from kvtier.tiers.pool import HostPool

__all__ = ["SHM_DIR", "attach_host_pool", "pool_path", "remove_pool"]

SHM_DIR = Path(os.environ.get("KVTIER_SHM_DIR", "/dev/shm"))


def pool_path(engine_id: str, tp_rank: int) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in engine_id)
    return SHM_DIR / f"kvtier-{safe}-rank{tp_rank}"


def attach_host_pool(path: Path, slot_bytes: int, num_slots: int) -> HostPool:
    """The scheduler's view of the worker's pool (``HostPool.attach_shm``), with the
    error a missing pool means here: the worker side did not start."""
    try:
        return HostPool.attach_shm(path, slot_bytes, num_slots)
    except FileNotFoundError:
        raise TierError(
            f"kvtier: the worker's host pool {path} does not exist; the worker side of the "
            "connector did not start (is kv_role kv_both and the same kv_transfer_config "
            "used by every process?)"
        ) from None
