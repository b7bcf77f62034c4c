"""The one protocol every tier speaks, and the small value types it uses.

Invariants every implementation keeps (checked by ``tests/tiers/contract.py``):

* ``put`` is atomic: a concurrent or later reader sees the whole object or nothing.
* ``WriteMode.CREATE`` never replaces an existing object; ``OVERWRITE`` always does.
* ``get_into`` either fills ``dst[:meta.payload_len]`` with verified bytes and returns the
  meta, or returns ``None`` (a miss). Corrupt objects are counted, removed, and reported
  as misses; bytes that failed verification are never returned as a hit. With ``expect``
  (a ``ChunkSpec``) a chunk that differs from it in namespace, tokens, dtype, shape or
  payload length is such a miss too. So is a payload larger than ``dst`` (for an object
  of a persistent tier, also a corruption: its header disagrees with the reader's geometry).
* ``contains_prefix(keys)`` is the length of the longest prefix of ``keys`` that is
  present. It answers the prefix-cache question in one call.
* Faults of the backing store (disk full, endpoint down) are counted and turn into
  misses or failed puts; they never raise out of the data-path methods.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol, runtime_checkable

from kvtier.keys import ChunkKey
from kvtier.metrics import TierMetrics
from kvtier.objformat import ChunkMeta, ChunkSpec


class WriteMode(StrEnum):
    CREATE = "create"
    OVERWRITE = "overwrite"


class PutStatus(StrEnum):
    STORED = "stored"
    EXISTS = "exists"  # CREATE found the object already there; nothing changed
    NO_SPACE = "no_space"  # capacity could not be freed (everything protected)
    FAILED = "failed"  # the backing store failed (I/O error, endpoint down)


class TierError(Exception):
    """A tier could not be set up. The message names the setting to change."""


@dataclass(frozen=True)
class ObjectInfo:
    key: ChunkKey
    size: int
    last_used: float  # wall-clock seconds


@dataclass(frozen=True)
class TierUsage:
    objects: int
    bytes: int
    capacity: int


class Tier(Protocol):
    """A store of verified chunks keyed by ``ChunkKey``."""

    #: Counters of this tier (hits, misses, bytes, errors, ...).
    metrics: TierMetrics

    @property
    def name(self) -> str: ...

    def indexed(self, key: ChunkKey) -> bool:
        """Known to this process's index: memory only, never I/O (vLLM's scheduler thread
        may call it). A persistent tier's index can be stale both ways: ``contains_prefix``
        asks the store itself."""
        ...

    def contains_prefix(self, keys: Sequence[ChunkKey]) -> int: ...

    def get_into(
        self, key: ChunkKey, dst: memoryview, *, expect: ChunkSpec | None = None
    ) -> ChunkMeta | None: ...

    def put(
        self, meta: ChunkMeta, payload: memoryview, mode: WriteMode = WriteMode.CREATE
    ) -> PutStatus: ...

    def delete(self, keys: Iterable[ChunkKey]) -> int: ...

    def scan(self) -> Iterator[ObjectInfo]: ...

    def usage(self) -> TierUsage: ...

    def collect(self) -> int:
        """Enforce capacity now; returns the number of bytes freed."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class SharedTier(Tier, Protocol):
    """A tier several nodes share (file, S3), with per-object leases (``kvtier.lease``).

    The lease start is the object's shared recency stamp (file mtime, S3 ``kvtier-used``):
    every read renews it at most once per ``touch_interval``; ``renew`` restarts it now.
    A lease is a minimum retention, not a validity bound: an expired object still holds
    correct KV until ``expire`` removes it.
    """

    def read_meta(self, key: ChunkKey) -> ChunkMeta | None: ...

    def present(self, key: ChunkKey) -> bool:
        """Is ``key`` in the store now? Asks the store, never this node's index (which
        learns of other nodes' deletions late); the index is refreshed either way. I/O."""
        ...

    def renew(self, key: ChunkKey) -> bool: ...

    def expire(self, lease_seconds: float) -> int: ...


def as_bytes_view(buf: object) -> memoryview:
    """A flat, byte-typed view of any C-contiguous buffer (bytes, numpy, torch.numpy())."""
    mv = memoryview(buf)  # type: ignore[arg-type]
    if not mv.c_contiguous:
        raise ValueError("buffer must be C-contiguous")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
