"""The host pool shared between vLLM's worker process and its scheduler process, and what
the worker publishes next to it.

vLLM builds the worker's KV caches before it constructs the scheduler (``EngineCore``
runs ``_initialize_kv_caches``, whose ``initialize_from_config`` reaches every worker's
``register_kv_caches``, before it creates the ``Scheduler`` and with it the scheduler-side
connector). So the worker creates the pool (it owns the bytes it copies) and the scheduler
attaches to it by name (it owns the index and the lower-tier I/O). The name is derived
from the engine id, which every process reads from the same ``VllmConfig`` (vLLM draws a
unique ``engine_id`` when none is set, and broadcasts it to every rank).

*Tensor parallel.* One pool per engine: a slot holds every rank's bytes of a chunk, rank
after rank. TP rank 0's worker creates it; after a barrier of the TP group the other
ranks' workers attach without unlinking it (``HostPool.attach_shm(unlink=False)``); the
scheduler attaches last and unlinks the name. Each worker copies only its own range.

Every process holds it as a ``HostPool`` of the same ``slot_bytes`` and ``num_slots``
(``HostPool.slots_for`` of the same capacity): rank 0's worker's from
``HostPool.create_shm``, the others' from ``HostPool.attach_shm``, the scheduler's from
``attach_host_pool``. The memory itself is ``kvtier.hostmem``'s.

Next to the pool each rank's worker publishes a ``PhysicalKV`` (``publish_physical``,
one file per rank): the KV layout its tensors really have and the digest of its fp8 k/v
scales, which only the worker can see and which the scheduler's namespace must cover
(``read_physical``, for every rank).

Invariants:

* The creator makes a new file (``O_EXCL | O_NOFOLLOW``): a name already taken, by a file
  or a symlink, is an error naming the path and what to do; it is never shared.
* The creator sizes the file once and touches every page before anyone uses it.
* The attacher checks the size it expects against the file; a mismatch (two processes
  that disagree on the geometry) is an error, never a silent misread.
* The attacher unlinks the name once mapped, so nothing leaks in ``/dev/shm`` after a
  crash; the creator unlinks too (``remove_pool``, ignoring ENOENT) at shutdown.
* The published file appears whole or not at all (temp file, then ``rename``), is read
  without following a symlink, and names the pool file it describes (device and inode):
  a missing file, or one of another engine, rank, pool or chunk size, is an error; the
  scheduler never keys by a layout it did not get from this engine's worker.

Thread safety: stateless; call from the thread that builds or closes a side.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
from pathlib import Path
from typing import Any

from kvtier.hostmem import remove_shared as remove_pool
from kvtier.tiers.base import TierError
from kvtier.tiers.fsutil import CREATE_FLAGS, NotRegular, open_regular, write_all
from kvtier.tiers.pool import HostPool
from kvtier.vllm.physical import PhysicalKV

__all__ = [
    "SHM_DIR",
    "attach_host_pool",
    "pool_path",
    "publish_physical",
    "published_path",
    "read_all_physical",
    "read_physical",
    "remove_pool",
    "remove_published",
]

SHM_DIR = Path(os.environ.get("KVTIER_SHM_DIR", "/dev/shm"))

#: Version of the published file's schema.
PUBLISHED_VERSION = 1
_MAX_PUBLISHED = 64 * 1024


def pool_path(engine_id: str) -> Path:
    """The engine's one host pool (every TP rank's bytes in each slot)."""
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in engine_id)
    return SHM_DIR / f"kvtier-{safe}"


def attach_host_pool(path: Path, slot_bytes: int, num_slots: int) -> HostPool:
    """The scheduler's view of the worker's pool (``HostPool.attach_shm``), with the
    error a missing pool means here: the worker side did not start."""
    try:
        return HostPool.attach_shm(path, slot_bytes, num_slots)
    except FileNotFoundError:
        raise TierError(_no_worker(path)) from None


def _no_worker(path: Path) -> str:
    return (
        f"kvtier: the worker's host pool {path} does not exist; the worker side of the "
        "connector did not start (is the same kv_transfer_config used by every process?)"
    )


# -- what the worker publishes -----------------------------------------------------------
def published_path(pool: Path, tp_rank: int = 0) -> Path:
    """Where TP rank ``tp_rank``'s worker publishes its ``PhysicalKV``: next to the pool."""
    return pool.with_name(f"{pool.name}.rank{tp_rank}.kv.json")


def _pool_id(pool: Path) -> list[int]:
    st = os.stat(pool, follow_symlinks=False)
    return [st.st_dev, st.st_ino]


def publish_physical(
    pool: Path, physical: PhysicalKV, *, engine_id: str, tp_rank: int, slot_bytes: int
) -> Path:
    """Worker, after creating ``pool``: write ``physical`` next to it, atomically (a temp
    file of a random name created with ``O_EXCL | O_NOFOLLOW``, then ``rename``, which
    replaces whatever had the name, a symlink included, without following it)."""
    doc = {
        "kvtier": PUBLISHED_VERSION,
        "engine_id": engine_id,
        "tp_rank": tp_rank,
        "pool": _pool_id(pool),
        "slot_bytes": slot_bytes,
        "kv_layout": physical.kv_layout,
        "kv_cache_dtype": physical.kv_cache_dtype,
        "kv_scales": physical.kv_scales,
    }
    data = json.dumps(doc, sort_keys=True).encode()
    final = published_path(pool, tp_rank)
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}-{secrets.token_hex(8)}")
    fd = os.open(tmp, CREATE_FLAGS, 0o600)
    try:
        try:
            write_all(fd, [memoryview(data)])
        finally:
            os.close(fd)
        os.rename(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    return final


def read_physical(pool: Path, *, engine_id: str, tp_rank: int, slot_bytes: int) -> PhysicalKV:
    """Scheduler: the ``PhysicalKV`` this engine's worker published for ``pool``.

    ``TierError`` saying what happened if it is missing, unreadable, or describes another
    engine, rank, pool file or chunk size. The file is removed once read (it is read once
    per engine start; nothing is left behind).
    """
    path = published_path(pool, tp_rank)
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        raise TierError(
            f"kvtier: {path} does not exist: the worker side publishes its KV layout there "
            "when vLLM registers the KV caches, before the scheduler starts; "
            + ("the worker did not start (is every process using the same "
               "kv_transfer_config and kvtier version?)" if not pool.exists()
               else "the worker's kvtier is another version (install one kvtier everywhere)")
        ) from None
    except NotRegular:
        raise TierError(f"kvtier: {path} is not a regular file (a symlink?); remove it") from None
    try:
        raw = os.read(fd, _MAX_PUBLISHED + 1)
    finally:
        os.close(fd)
    doc = _parse(path, raw)
    expect: dict[str, Any] = {"kvtier": PUBLISHED_VERSION, "engine_id": engine_id,
                              "tp_rank": tp_rank, "slot_bytes": slot_bytes}
    for field, want in expect.items():
        if doc.get(field) != want:
            raise TierError(
                f"kvtier: {path} has {field} {doc.get(field)!r}, this scheduler expects "
                f"{want!r}; it was written by another engine or kvtier version (remove it "
                "and restart the engine)"
            )
    try:
        pool_id = _pool_id(pool)
    except FileNotFoundError:
        raise TierError(_no_worker(pool)) from None
    if doc.get("pool") != pool_id:
        raise TierError(
            f"kvtier: {path} describes another host pool file than {pool} (left over from an "
            "earlier engine?); remove both and restart the engine"
        )
    remove_published(pool, tp_rank)
    return PhysicalKV(doc["kv_layout"], doc["kv_cache_dtype"], doc["kv_scales"])


def read_all_physical(
    pool: Path, *, engine_id: str, tp_world: int, slot_bytes: int, replicated: bool = False
) -> PhysicalKV:
    """Scheduler: every rank's ``PhysicalKV`` (``read_physical``), as one. The ranks of an
    engine build their caches alike, so their layouts and cache dtypes must agree
    (``TierError`` otherwise); the scales digest covers every rank's scales, in rank
    order (rank 0's alone at TP 1). A ``replicated`` cache (MLA: every rank holds the
    same KV, stored once) must have the same scales on every rank, and its digest is
    rank 0's, so that engines of any TP size share its objects."""
    ranks = [read_physical(pool, engine_id=engine_id, tp_rank=r, slot_bytes=slot_bytes)
             for r in range(tp_world)]
    first = ranks[0]
    for r, other in enumerate(ranks[1:], 1):
        if (other.kv_layout, other.kv_cache_dtype) != (first.kv_layout, first.kv_cache_dtype):
            raise TierError(
                f"kvtier: TP rank {r} registered KV caches as {other.kv_layout} "
                f"({other.kv_cache_dtype}) but rank 0 as {first.kv_layout} "
                f"({first.kv_cache_dtype}); every rank must use one attention backend"
            )
    if tp_world == 1:
        return first
    if replicated:
        if any(p.kv_scales != first.kv_scales for p in ranks):
            raise TierError("kvtier: the TP ranks of this MLA model registered different KV "
                            "scales for one replicated cache; run it without kvtier")
        return first
    scales = hashlib.sha256("|".join(p.kv_scales for p in ranks).encode()).hexdigest()[:32]
    return PhysicalKV(first.kv_layout, first.kv_cache_dtype, scales)


def _parse(path: Path, raw: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(raw) if len(raw) <= _MAX_PUBLISHED else None
    except ValueError:
        doc = None
    strings = ("engine_id", "kv_layout", "kv_cache_dtype", "kv_scales")
    if not (isinstance(doc, dict) and all(isinstance(doc.get(k), str) for k in strings)):
        raise TierError(f"kvtier: {path} is not a kvtier layout file; remove it and restart")
    return doc


def remove_published(pool: Path, tp_rank: int = 0) -> None:
    """Unlink rank ``tp_rank``'s published file of ``pool``; a name already gone is fine."""
    with contextlib.suppress(FileNotFoundError):
        published_path(pool, tp_rank).unlink()
