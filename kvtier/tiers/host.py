"""``HostTier``: chunks in a host-memory pool (pinned, i.e. page-locked, when CUDA is
present).

Composes a ``SlotIndex`` (keys, states, recency) with a ``HostPool`` (bytes): its own
private pool (``HostTier(capacity, slot_bytes)``), or one it is handed
(``HostTier.over(pool)``: a pool shared with another process). Besides the copying
``Tier`` methods it offers zero-copy access for the store: ``reserve(key)`` /
``commit(slot, meta)`` / ``abort`` to fill a slot in place, and ``hold`` / ``release`` to
read one in place (a held slot is never evicted). Host memory is trusted, so reads are
not checksummed; persistent tiers checksum everything. A reader's ``ChunkSpec`` is still
checked against the slot's meta.

Thread safety: every method may be called from any thread (the index is atomic, the pool
immutable); the bytes of a slot are written only by whoever reserved it, before
``commit``, and read only under a hold.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from kvtier.clock import SYSTEM_CLOCK, Clock
from kvtier.keys import ChunkKey
from kvtier.metrics import TierMetrics
from kvtier.objformat import ChunkMeta, ChunkSpec
from kvtier.policy import EvictionPolicy, LRUPolicy
from kvtier.tiers.base import ObjectInfo, PutStatus, TierUsage, WriteMode
from kvtier.tiers.pool import Allocator, HostPool
from kvtier.tiers.slots import Reservation, SlotIndex

log = logging.getLogger("kvtier.host")


class HostTier:
    def __init__(
        self,
        capacity_bytes: int,
        slot_bytes: int,
        *,
        policy: EvictionPolicy | None = None,
        allocator: Allocator | None = None,
        name: str = "host",
        check_memory: bool = True,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        pool = HostPool.allocate(
            capacity_bytes, slot_bytes, allocator=allocator, check_memory=check_memory
        )
        self._setup(pool, policy, name, clock)

    @classmethod
    def over(
        cls, pool: HostPool, *, policy: EvictionPolicy | None = None, name: str = "host",
        clock: Clock = SYSTEM_CLOCK,
    ) -> HostTier:
        """A host tier over an existing ``pool`` (e.g. ``HostPool.attach_shm``), empty."""
        tier = cls.__new__(cls)
        tier._setup(pool, policy, name, clock)
        return tier

    def _setup(
        self, pool: HostPool, policy: EvictionPolicy | None, name: str, clock: Clock
    ) -> None:
        self._name = name
        self.pool = pool
        self.clock = clock  # dirty ages (SlotIndex.take_dirty(older_than=...))
        self.index = SlotIndex(pool.num_slots, policy or LRUPolicy(), clock=clock)
        self.metrics = TierMetrics(name)

    @property
    def name(self) -> str:
        return self._name

    @property
    def slot_bytes(self) -> int:
        return self.pool.slot_bytes

    # -- zero-copy access -------------------------------------------------------------
    def check_fits(self, meta: ChunkMeta) -> None:
        """``ValueError`` if ``meta``'s payload is larger than a slot."""
        if meta.payload_len > self.pool.slot_bytes:
            raise ValueError(
                f"chunk of {meta.payload_len} bytes does not fit a {self.pool.slot_bytes}-byte "
                "slot; the pool was sized for another chunk geometry"
            )

    def reserve(self, key: ChunkKey, *, backup: bool = False) -> Reservation | None:
        """A WRITING slot for ``key`` (see ``SlotIndex.reserve``, also for ``backup``); fill
        it, then ``commit`` or ``abort``."""
        r = self.index.reserve(key, backup=backup)
        if r is not None and r.evicted:
            self.metrics.evicted(len(r.evicted))
        return r

    def commit(self, slot: int, meta: ChunkMeta, *, dirty: bool = False) -> bool:
        """Publish a slot reserved for ``meta.key`` and filled with its bytes; False if
        another reservation of the key was published first (this slot is freed). A
        ``meta`` that does not fit a slot is refused: the slot is aborted and
        ``ValueError`` raised."""
        try:
            self.check_fits(meta)
        except ValueError:
            self.index.abort(slot)
            raise
        published = self.index.commit(slot, meta, dirty=dirty)
        self.metrics.used(len(self.index) * self.pool.slot_bytes)
        return published

    def abort(self, slot: int) -> None:
        self.index.abort(slot)

    def wait_settled(self, key: ChunkKey, timeout: float) -> bool:
        """``SlotIndex.wait_settled``: wait (IO threads only) until nobody is filling
        ``key``'s slot."""
        return self.index.wait_settled(key, timeout)

    def hold(
        self, key: ChunkKey, expect: ChunkSpec | None = None
    ) -> tuple[int, ChunkMeta] | None:
        """Hold ``key``'s slot for reading; ``None`` on a miss. With ``expect``, a slot whose
        meta differs is not held: it is counted as a corruption and dropped unless
        another reader holds it (dropping costs a recompute at worst)."""
        got = self.index.hold(key)
        if got is None or expect is None:
            return got
        why = expect.mismatch(got[1])
        if why is None:
            return got
        self.index.release(got[0])
        self.metrics.corrupt()
        log.warning("host chunk %s not served: %s", key.hex(), why)
        self.index.delete(key)
        return None

    def release(self, slot: int) -> None:
        """Give back one hold (``hold``, or ``take_dirty`` on the index)."""
        self.index.release(slot)

    def view(self, slot: int, nbytes: int | None = None) -> np.ndarray:
        return self.pool.view(slot, nbytes)

    # -- Tier protocol -----------------------------------------------------------------
    def contains_prefix(self, keys: Sequence[ChunkKey]) -> int:
        return self.index.contains_prefix(keys)

    def get_into(
        self, key: ChunkKey, dst: memoryview, *, expect: ChunkSpec | None = None
    ) -> ChunkMeta | None:
        t0 = time.perf_counter()
        got = self.hold(key, expect)
        if got is None:
            self.metrics.miss()
            return None
        slot, meta = got
        try:
            if meta.payload_len > memoryview(dst).nbytes:  # the caller's buffer is too small
                self.metrics.miss()
                return None
            out = np.frombuffer(dst, dtype=np.uint8, count=meta.payload_len)
            np.copyto(out, self.pool.view(slot, meta.payload_len))
        finally:
            self.index.release(slot)
        self.metrics.hit(meta.payload_len)
        self.metrics.observe("get", time.perf_counter() - t0)
        return meta

    def put(
        self, meta: ChunkMeta, payload: memoryview, mode: WriteMode = WriteMode.CREATE
    ) -> PutStatus:
        self.check_fits(meta)  # before anything is replaced
        if self.index.contains(meta.key):
            if mode is WriteMode.CREATE:
                return PutStatus.EXISTS
            if not self.index.delete(meta.key):
                return PutStatus.NO_SPACE  # held by a reader: cannot replace now
        t0 = time.perf_counter()
        r = self.reserve(meta.key)
        if r is None:
            return PutStatus.EXISTS if self.index.contains(meta.key) else PutStatus.NO_SPACE
        try:
            src = np.frombuffer(payload, dtype=np.uint8, count=meta.payload_len)
            np.copyto(self.pool.view(r.slot, meta.payload_len), src)
        except BaseException:
            self.abort(r.slot)
            raise
        self.commit(r.slot, meta)
        self.metrics.wrote(meta.payload_len)
        self.metrics.observe("put", time.perf_counter() - t0)
        return PutStatus.STORED

    def indexed(self, key: ChunkKey) -> bool:
        return self.index.contains(key)

    def delete(self, keys: Iterable[ChunkKey]) -> int:
        n = sum(self.index.delete(k) for k in keys)
        self.metrics.used(len(self.index) * self.pool.slot_bytes)
        return n

    def scan(self) -> Iterator[ObjectInfo]:
        for _, meta in self.index.entries():
            yield ObjectInfo(meta.key, meta.payload_len, 0.0)

    def usage(self) -> TierUsage:
        n = len(self.index)
        return TierUsage(n, n * self.pool.slot_bytes, self.pool.nbytes)

    def collect(self) -> int:
        return 0  # capacity is enforced slot by slot in reserve()

    def close(self) -> None:
        pass
