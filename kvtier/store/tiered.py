"""``TieredStore``: an ordered list of tiers, host first, that owns cascade and promotion.

Data flows (each in the module named):

* Writes (``writes``): ``put`` / ``reserve(key)``+``commit(slot, meta)`` write into the
  host tier only (the one entry point for filling host slots: a slot is reserved for a
  key and gets its meta when committed); the caller never waits on storage. Each
  write-through tier gets the chunk queued at once. With write-back tiers the chunk is
  *dirty* until one of them holds it.
* Write-back (``writeback``): the pool spills ahead of need: whenever free-or-clean host
  slots, counting those whose spill is in flight, fall below the *low-water mark*
  (``clean_reserve`` of the pool, at least one slot), the coldest dirty chunks are queued
  to the write-back tiers. Each turns clean, and so evictable, once ONE write-back tier
  holds it; a spill that every write-back tier failed leaves it dirty. Checked after
  every commit and every reservation (a save's or a promotion's), and when a promotion
  finds no slot: a save or a restore finds a clean slot instead of failing for want of
  one, as long as the tier keeps up.
* Reads (``reads``): ``lookup_indexed`` answers "how long is the stored prefix, and where
  is each chunk"; ``load(found)`` takes that answer, promotes its lower-tier entries into
  host slots (on the IO pool, ahead of stores) from the tier the lookup named, and hands
  back the chunks *held* (``Held``), so they cannot be evicted before the caller copies
  them.
* Upkeep (``upkeep``): resets of the host tier, idle and shutdown flushes, waiting for
  queued writes, closing.

Every part works on one ``StoreState`` (``state``), whose docstring states which lock
guards what and which thread may call what.

Invariants:

* A dirty chunk is never evicted. It turns clean once ONE write-back tier holds it (the
  others give that copy up, counted: one tier's trouble never keeps host slots dirty);
  a write that every write-back tier failed leaves it dirty (nothing stored is lost) and
  restarts its age. The store is a cache: losing a chunk costs a recompute, serving a
  wrong one is never allowed.
* A store queue that is full drops the write and counts it (``kvtier_drops_total``).
* What ``load`` serves is what the reader expects, never a stale lookup's guess, and it
  leaks no slot (``reads``).
"""

from __future__ import annotations

from kvtier.store.reads import Reads
from kvtier.store.upkeep import Upkeep
from kvtier.store.writes import Writes


class TieredStore(Reads, Writes, Upkeep):
    """The host tier and the lower tiers as one store. Built from ``StoreState``'s
    arguments (``host``, ``lower``, ``io``, ...); its methods come from the parts:
    ``Reads`` (lookup, probe, load), ``Writes`` (reserve, commit, put, write-through),
    ``Upkeep`` (resets, flushes, shutdown), all over ``WriteBack`` (spills, the write of
    one slot below) and ``StoreState`` (fields, lock rules, health questions)."""
