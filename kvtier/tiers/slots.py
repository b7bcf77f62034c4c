"""``SlotIndex``: the bookkeeping half of the host tier. Keys, slots, states; no bytes.

Slot life cycle (a bad transition raises ``SlotStateError`` naming the current state)::

    FREE --reserve--> WRITING --commit--> READY --evict/remove--> FREE
                         \\--abort--> FREE

Invariants:

* A key maps to at most one slot, and only READY slots are visible to lookups.
* A slot with ``readers > 0`` (being read, or being spilled to a lower tier) or in state
  WRITING is never evicted or removed.
* A ``dirty`` slot holds data not yet persisted to the write-back tiers; it is never
  evicted, only spilled first (``take_dirty``) and then marked clean.
* All methods are atomic under one lock; none does I/O.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from enum import Enum

from kvtier.keys import ChunkKey
from kvtier.objformat import ChunkMeta
from kvtier.policy import EvictionPolicy


class SlotState(Enum):
    FREE = "free"
    WRITING = "writing"
    READY = "ready"


class SlotStateError(RuntimeError):
    """An illegal slot transition: a bug in the caller, never healed silently."""


@dataclass
class _Slot:
    state: SlotState = SlotState.FREE
    meta: ChunkMeta | None = None
    readers: int = 0
    dirty: bool = False


@dataclass(frozen=True)
class Reservation:
    slot: int
    evicted: tuple[ChunkKey, ...]


class SlotIndex:
    def __init__(self, num_slots: int, policy: EvictionPolicy) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be > 0, got {num_slots}")
        self._slots = [_Slot() for _ in range(num_slots)]
        self._free = list(range(num_slots - 1, -1, -1))
        self._by_key: dict[ChunkKey, int] = {}
        self._pending: set[ChunkKey] = set()  # keys being written
        self._dirty = 0
        self._policy = policy
        self._lock = threading.Lock()

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    def _expect(self, slot: int, state: SlotState) -> _Slot:
        s = self._slots[slot]
        if s.state is not state:
            raise SlotStateError(f"slot {slot} is {s.state.value}, expected {state.value}")
        return s

    def _evictable(self, key: ChunkKey) -> bool:
        s = self._slots[self._by_key[key]]
        return s.readers == 0 and not s.dirty

    def reserve(self, meta: ChunkMeta) -> Reservation | None:
        """A WRITING slot for ``meta.key``, evicting one clean LRU chunk if needed.

        Returns ``None`` when the key is already present or being written, or when no
        slot can be freed (everything pinned or dirty).
        """
        with self._lock:
            if meta.key in self._by_key or meta.key in self._pending:
                return None
            evicted: tuple[ChunkKey, ...] = ()
            if not self._free:
                victims = self._policy.evict(1, self._evictable)
                if victims is None:
                    return None
                for key in victims:
                    slot = self._by_key.pop(key)
                    self._slots[slot] = _Slot()
                    self._free.append(slot)
                evicted = tuple(victims)
            slot = self._free.pop()
            s = self._expect(slot, SlotState.FREE)
            s.state, s.meta = SlotState.WRITING, meta
            self._pending.add(meta.key)
            return Reservation(slot, evicted)

    def commit(self, slot: int, *, dirty: bool) -> None:
        with self._lock:
            s = self._expect(slot, SlotState.WRITING)
            assert s.meta is not None
            self._pending.discard(s.meta.key)
            s.state, s.dirty = SlotState.READY, dirty
            self._dirty += dirty
            self._by_key[s.meta.key] = slot
            self._policy.insert(s.meta.key)

    def set_meta(self, slot: int, meta: ChunkMeta) -> None:
        """Replace a WRITING slot's meta once its bytes are known (same key only)."""
        with self._lock:
            s = self._expect(slot, SlotState.WRITING)
            assert s.meta is not None
            if s.meta.key != meta.key:
                raise SlotStateError(f"slot {slot} was reserved for another key")
            s.meta = meta

    def abort(self, slot: int) -> None:
        with self._lock:
            s = self._expect(slot, SlotState.WRITING)
            assert s.meta is not None
            self._pending.discard(s.meta.key)
            self._slots[slot] = _Slot()
            self._free.append(slot)

    def acquire(self, key: ChunkKey) -> tuple[int, ChunkMeta] | None:
        """Pin ``key``'s slot for reading and refresh its recency; ``None`` on a miss."""
        with self._lock:
            slot = self._by_key.get(key)
            if slot is None:
                return None
            s = self._expect(slot, SlotState.READY)
            s.readers += 1
            self._policy.touch(key)
            assert s.meta is not None
            return slot, s.meta

    def release(self, slot: int) -> None:
        with self._lock:
            s = self._expect(slot, SlotState.READY)
            if s.readers <= 0:
                raise SlotStateError(f"slot {slot} released more times than acquired")
            s.readers -= 1

    def contains_prefix(self, keys: Sequence[ChunkKey]) -> int:
        with self._lock:
            for i, key in enumerate(keys):
                if key not in self._by_key:
                    return i
            return len(keys)

    def contains(self, key: ChunkKey) -> bool:
        with self._lock:
            return key in self._by_key

    def take_dirty(
        self,
        max_n: int,
        *,
        hottest_first: bool = False,
        skip: Collection[ChunkKey] = (),
    ) -> list[tuple[int, ChunkMeta]]:
        """Pin up to ``max_n`` dirty, unpinned chunks for writing below: the coldest (a
        spill), or the most recently used (a shutdown flush). Keys in ``skip`` are left."""
        out: list[tuple[int, ChunkMeta]] = []
        with self._lock:
            order = self._policy.coldest()
            for key in reversed(list(order)) if hottest_first else order:
                if len(out) == max_n:
                    break
                slot = self._by_key[key]
                s = self._slots[slot]
                if s.dirty and s.readers == 0 and key not in skip:
                    s.readers += 1
                    assert s.meta is not None
                    out.append((slot, s.meta))
        return out

    def dirty_keys(self) -> set[ChunkKey]:
        with self._lock:
            return {k for k, slot in self._by_key.items() if self._slots[slot].dirty}

    def mark_clean(self, slot: int, key: ChunkKey | None = None) -> None:
        """The slot's chunk is stored below. With ``key``: only if the slot still holds it."""
        with self._lock:
            s = self._expect(slot, SlotState.READY)
            if key is not None and (s.meta is None or s.meta.key != key):
                return
            self._dirty -= s.dirty
            s.dirty = False

    def clean_or_free(self) -> int:
        """Slots a ``reserve`` could use without waiting for a spill."""
        with self._lock:
            return len(self._slots) - self._dirty - len(self._pending)

    def remove(self, key: ChunkKey) -> bool:
        """Drop ``key`` if present and unpinned. Returns whether it was removed."""
        with self._lock:
            slot = self._by_key.get(key)
            if slot is None or self._slots[slot].readers:
                return False
            del self._by_key[key]
            self._policy.remove(key)
            self._dirty -= self._slots[slot].dirty
            self._slots[slot] = _Slot()
            self._free.append(slot)
            return True

    def entries(self) -> list[tuple[int, ChunkMeta]]:
        with self._lock:
            out = []
            for slot in self._by_key.values():
                meta = self._slots[slot].meta
                assert meta is not None
                out.append((slot, meta))
            return out

    def num_readers(self) -> int:
        """Reads in progress over all slots (acquired and not yet released)."""
        with self._lock:
            return sum(s.readers for s in self._slots)

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_key)
