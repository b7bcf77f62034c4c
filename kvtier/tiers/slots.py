"""``SlotIndex``: the bookkeeping half of the host tier. Keys, slots, states; no bytes.

Slot life cycle (a bad transition raises ``SlotStateError`` naming the current state)::

    FREE --reserve(key)--> WRITING --commit(meta)--> READY --evict/delete--> FREE
                              \\--abort--> FREE
                              \\--commit of a duplicate--> FREE

A slot is reserved for a *key*: what the chunk is (its ``ChunkMeta``) is known only once
its bytes are, and is given at ``commit`` (a promotion learns it from the tier it reads).

*Backups.* ``reserve(key, backup=True)`` gives a second WRITING slot for a key that
another caller is writing (a request saving a prefix that another request is saving at
the same moment, and that must not depend on that other save succeeding). Whichever
reservation of a key commits first is published; a later commit of the same key frees
its slot and returns False (the bytes are the same chunk; nothing is lost).

Invariants:

* A key maps to at most one READY slot, and only READY slots are visible to lookups
  (``contains``, ``hold``, ``entries``, ``take_dirty``). A key has at most one WRITING
  slot unless the others were reserved as backups; ``pending`` says whether any is.
* A WRITING slot has a key and no meta; a READY slot has a meta whose key is the key it
  was reserved for (``commit`` refuses another). Nothing reads the meta of a slot that is
  not READY.
* A *held* slot (``holds > 0``: being read, or being spilled to a lower tier; ``hold``
  and ``take_dirty`` take holds, ``release`` gives one back) or a WRITING one is never
  evicted or deleted.
* A ``dirty`` slot holds data not yet persisted to the write-back tiers; it is never
  evicted, only spilled first (``take_dirty``), and marked clean once one write-back
  tier holds it (one that every write-back tier failed stays dirty).
* All methods are atomic under one lock and none does I/O, so any thread may call any
  of them; the lock is never held across a caller's work.

*Costs under the lock.* Only clean READY keys are in the eviction policy; dirty ones are
in the index's own recency order (``_dirty_lru``) and its age order (``_dirty_order``).
So ``reserve`` skips only held keys (reads in flight) when it looks for a victim, and a
spill (``take_dirty``) walks dirty keys only, never the whole LRU: neither cost grows with
the pool. A chunk that turns clean rejoins the policy at the cold end if it was used less
recently than the coldest clean chunk (a spilled chunk, the usual case), else at the hot
end: recency is kept exactly where it matters, for the next eviction.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from enum import Enum

from kvtier.clock import SYSTEM_CLOCK, Clock
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
    key: ChunkKey | None = None  # set unless FREE
    meta: ChunkMeta | None = None  # set only when READY
    holds: int = 0
    dirty: bool = False
    dirty_since: float = 0.0  # clock.monotonic() at the commit that made it dirty
    used: int = 0  # the index's use counter at its last commit or hold

    def ready_meta(self) -> ChunkMeta:
        assert self.state is SlotState.READY and self.meta is not None
        return self.meta


@dataclass(frozen=True)
class Reservation:
    slot: int
    evicted: tuple[ChunkKey, ...]


class SlotIndex:
    def __init__(
        self, num_slots: int, policy: EvictionPolicy, *, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be > 0, got {num_slots}")
        self._slots = [_Slot() for _ in range(num_slots)]
        self._free = list(range(num_slots - 1, -1, -1))
        self._by_key: dict[ChunkKey, int] = {}
        self._pending: dict[ChunkKey, int] = {}  # keys being written: WRITING slots each
        self._writing = 0  # WRITING slots in all
        self._dirty = 0
        #: dirty READY slots, oldest dirty first (slot -> dirty_since): aged write-back
        #: picks from the front in O(picked), never scanning the LRU under the lock
        self._dirty_order: OrderedDict[int, float] = OrderedDict()
        #: dirty READY keys, least recently used first (key -> slot); never in the policy
        self._dirty_lru: OrderedDict[ChunkKey, int] = OrderedDict()
        self._uses = 0
        self._policy = policy
        self._clock = clock  # dirty ages only (take_dirty(older_than=...))
        self._lock = threading.Lock()
        #: notified whenever a key stops being written (its slot committed or aborted)
        self._settled = threading.Condition(self._lock)
        #: Told ``(True, key)`` when a key becomes READY (committed) and ``(False, key)``
        #: when a READY key leaves (evicted, deleted): the KV event stream
        #: (``kvtier.vllm.events``). Called under the index lock from whichever thread
        #: changed it, so it must only enqueue (never block, never call back in).
        self.observer: Callable[[bool, ChunkKey], None] | None = None

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    def _expect(self, slot: int, state: SlotState) -> _Slot:
        s = self._slots[slot]
        if s.state is not state:
            raise SlotStateError(f"slot {slot} is {s.state.value}, expected {state.value}")
        return s

    def _evictable(self, key: ChunkKey) -> bool:
        return self._slots[self._by_key[key]].holds == 0  # the policy holds clean keys only

    def _touch(self, s: _Slot) -> None:
        self._uses += 1
        s.used = self._uses

    def reserve(self, key: ChunkKey, *, backup: bool = False) -> Reservation | None:
        """A WRITING slot for ``key``, evicting one clean, unheld LRU chunk if needed.

        Returns ``None`` when the key is already present, or being written (unless
        ``backup``: then another WRITING slot for the same key; the first commit wins), or
        when no slot can be freed (everything held or dirty).
        """
        with self._lock:
            if key in self._by_key or (key in self._pending and not backup):
                return None
            if backup and self._pending.get(key, 0) > 1:
                return None  # one backup per key is enough: its chain is whole either way
            evicted: tuple[ChunkKey, ...] = ()
            if not self._free:
                victims = self._policy.evict(1, self._evictable)
                if victims is None:
                    return None
                for victim in victims:
                    slot = self._by_key.pop(victim)
                    self._slots[slot] = _Slot()
                    self._free.append(slot)
                evicted = tuple(victims)
                if self.observer is not None:
                    for victim in evicted:
                        self.observer(False, victim)
            slot = self._free.pop()
            s = self._expect(slot, SlotState.FREE)
            s.state, s.key = SlotState.WRITING, key
            self._pending[key] = self._pending.get(key, 0) + 1
            self._writing += 1
            return Reservation(slot, evicted)

    def _unpend(self, key: ChunkKey) -> None:
        n = self._pending[key] - 1
        if n:
            self._pending[key] = n
        else:
            del self._pending[key]
            self._settled.notify_all()
        self._writing -= 1

    def wait_settled(self, key: ChunkKey, timeout: float) -> bool:
        """Block until ``key`` has no WRITING slot (its writer committed or aborted), at
        most ``timeout`` seconds; True if it has none by then. For IO threads: a read
        that finds another thread filling the slot it wants waits for that fill instead
        of giving up the chunk."""
        with self._settled:
            return self._settled.wait_for(lambda: key not in self._pending, timeout)

    def commit(self, slot: int, meta: ChunkMeta, *, dirty: bool) -> bool:
        """Publish a WRITING slot as ``meta``'s chunk; True if it was published. False if
        another reservation of the key committed first: this slot is freed (a backup that
        lost the race). ``SlotStateError`` (nothing changed) if the slot is not WRITING or
        was reserved for another key."""
        with self._lock:
            s = self._expect(slot, SlotState.WRITING)
            if s.key != meta.key:
                raise SlotStateError(
                    f"slot {slot} was reserved for another key than {meta.key.hex()}"
                )
            self._unpend(meta.key)
            if meta.key in self._by_key:
                self._slots[slot] = _Slot()
                self._free.append(slot)
                return False
            s.state, s.meta, s.dirty = SlotState.READY, meta, dirty
            s.dirty_since = self._clock.monotonic() if dirty else 0.0
            self._touch(s)
            if dirty:
                self._dirty_order[slot] = s.dirty_since
                self._dirty_lru[meta.key] = slot
            else:
                self._policy.insert(meta.key)
            self._dirty += dirty
            self._by_key[meta.key] = slot
            if self.observer is not None:
                self.observer(True, meta.key)
            return True

    def abort(self, slot: int) -> None:
        """Give back a WRITING slot; nothing was published."""
        with self._lock:
            s = self._expect(slot, SlotState.WRITING)
            assert s.key is not None
            self._unpend(s.key)
            self._slots[slot] = _Slot()
            self._free.append(slot)

    def pending(self, key: ChunkKey) -> bool:
        """``key`` has a WRITING slot (someone is filling it; it is not READY yet)."""
        with self._lock:
            return key in self._pending

    def writers(self, key: ChunkKey) -> int:
        """How many WRITING slots ``key`` has (the first reservation and its backup)."""
        with self._lock:
            return self._pending.get(key, 0)

    def hold(self, key: ChunkKey) -> tuple[int, ChunkMeta] | None:
        """Hold ``key``'s slot for reading and refresh its recency; ``None`` on a miss.
        Each hold is given back with one ``release``."""
        with self._lock:
            slot = self._by_key.get(key)
            if slot is None:
                return None
            s = self._expect(slot, SlotState.READY)
            s.holds += 1
            self._touch(s)
            if s.dirty:
                self._dirty_lru.move_to_end(key)
            else:
                self._policy.touch(key)
            return slot, s.ready_meta()

    def release(self, slot: int) -> None:
        """Give back one hold of ``slot`` (from ``hold`` or ``take_dirty``)."""
        with self._lock:
            s = self._expect(slot, SlotState.READY)
            if s.holds <= 0:
                raise SlotStateError(f"slot {slot} released more times than held")
            s.holds -= 1

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
        older_than: float | None = None,
    ) -> list[tuple[int, ChunkMeta]]:
        """Hold up to ``max_n`` dirty, unheld chunks for writing below: the coldest (a
        spill), or the most recently used (a shutdown flush). Keys in ``skip`` are left,
        and with ``older_than`` (a ``clock.monotonic()`` reading) chunks dirty since after
        it. Each is given back with one ``release``."""
        out: list[tuple[int, ChunkMeta]] = []
        if max_n <= 0:
            return out
        with self._lock:
            if not self._dirty:
                return out
            if older_than is not None:  # oldest dirty first, from the front: O(picked)
                for slot, since in self._dirty_order.items():
                    if len(out) == max_n or since > older_than:
                        break
                    s = self._slots[slot]
                    if s.holds == 0 and s.ready_meta().key not in skip:
                        s.holds += 1
                        out.append((slot, s.ready_meta()))
                return out
            # dirty keys only, coldest (or hottest) first: O(dirty), never the whole LRU
            order = reversed(self._dirty_lru) if hottest_first else iter(self._dirty_lru)
            for key in order:
                if len(out) == max_n:
                    break
                slot = self._dirty_lru[key]
                s = self._slots[slot]
                if s.holds == 0 and key not in skip:
                    s.holds += 1
                    out.append((slot, s.ready_meta()))
        return out

    def dirty_keys(self) -> set[ChunkKey]:
        with self._lock:
            return set(self._dirty_lru)

    def mark_clean(self, slot: int, key: ChunkKey | None = None) -> None:
        """The slot's chunk is stored below. With ``key``: only if the slot still holds it."""
        with self._lock:
            s = self._expect(slot, SlotState.READY)
            if key is not None and s.ready_meta().key != key:
                return
            if not s.dirty:
                return
            self._dirty -= 1
            s.dirty = False
            self._dirty_order.pop(slot, None)
            mine = s.ready_meta().key
            del self._dirty_lru[mine]
            coldest = self._policy.coldest_key()
            cold = coldest is not None and s.used < self._slots[self._by_key[coldest]].used
            self._policy.insert(mine, cold=cold)

    def write_failed(self, slot: int, key: ChunkKey) -> None:
        """A write of the dirty chunk in ``slot`` failed: it stays dirty and its age starts
        again, so the aged write-back tries it again only ``max_dirty_seconds`` later
        (no retry storm while a tier is down). Nothing if the slot holds another chunk."""
        with self._lock:
            s = self._slots[slot]
            if s.state is not SlotState.READY or not s.dirty or s.ready_meta().key != key:
                return
            s.dirty_since = self._clock.monotonic()
            self._dirty_order.pop(slot, None)
            self._dirty_order[slot] = s.dirty_since

    def reservable(self) -> bool:
        """Whether a ``reserve`` of a new key would find a slot now: one free, or a
        clean, unheld chunk to evict. Scans the slots when none is free."""
        with self._lock:
            return bool(self._free) or any(
                s.state is SlotState.READY and not s.dirty and s.holds == 0
                for s in self._slots)

    def clean_or_free(self) -> int:
        """Slots a ``reserve`` could use without waiting for a spill."""
        with self._lock:
            return len(self._slots) - self._dirty - self._writing

    def delete(self, key: ChunkKey) -> bool:
        """Drop ``key`` if present and unheld. Returns whether it was deleted."""
        with self._lock:
            slot = self._by_key.get(key)
            if slot is None or self._slots[slot].holds:
                return False
            del self._by_key[key]
            if self._slots[slot].dirty:
                self._dirty -= 1
                del self._dirty_lru[key]
                self._dirty_order.pop(slot, None)
            else:
                self._policy.forget(key)
            self._slots[slot] = _Slot()
            self._free.append(slot)
            if self.observer is not None:
                self.observer(False, key)
            return True

    def entries(self) -> list[tuple[int, ChunkMeta]]:
        with self._lock:
            return [(slot, self._slots[slot].ready_meta()) for slot in self._by_key.values()]

    def num_held(self) -> int:
        """Holds outstanding over all slots (taken and not yet released)."""
        with self._lock:
            return sum(s.holds for s in self._slots)

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_key)
