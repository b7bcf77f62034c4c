"""``CompactIndex``: what a persistent tier (file, S3) knows of its objects, in 44 bytes an
entry plus an open-addressing table of 4-byte cells.

The storage (a slab of numpy arrays, the hash table, versions, the lock-free ``in``) is
``kvtier.tiers.keytable``'s ``KeyTable``; this class adds the recency list (the links of
a doubly linked list, coldest first) and the changes callers make.

Invariants:

* Linked entries are ordered by when this node recorded them, coldest first; ``bytes`` is
  the sum of every entry's size (linked or not). Entries the walk finds or refreshes
  (``remember_placed``: another node's objects, newer stamps) wait unlinked until
  ``link_placed`` puts them where their recency belongs, not at the hot end: appended when
  none is older than the hot end, else by one vectorised re-sort of the whole list by
  ``(recency, version)`` (O(n log n) numpy under the lock, like a table rebuild: 50 ms at
  a million entries; once per walk tick that found an older one). Issue 32: other
  nodes' objects used to land at the hot end whatever their mtime, so a node evicted its
  own unused objects first.
* Entries a start scan added (``add_scanned``) are in the table (lookups see them) but not
  linked until ``finish_scan`` links them all, sorted by recency, at the cold end: a scan
  finds objects in directory order, and eviction must not follow that order.
* Every method but ``in`` is atomic under one private lock that no caller can hold across
  a call, and nothing under it does I/O. A writer may hold it for long: a start scan's
  batch, a table rebuild or a slab growth (O(n) numpy work, 0.2 s at a million entries,
  seconds at ten million), and Python's lock is not fair, so a scan inserting batch after
  batch can keep a waiter out for most of a second. ``key in index`` (vLLM's scheduler
  thread asks it, through ``ObjectTier.indexed``) takes no lock (``KeyTable``).
* An ``Entry`` read earlier is a version: ``forget_if``/``replace_if`` change the index
  only if nobody recorded anything for the key since.
* Any thread may call any method.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import numpy as np

from kvtier.keys import ChunkKey
from kvtier.tiers.keytable import _FREE, _NIL, _PLACED, _UNLINKED, KeyTable, split
from kvtier.tiers.keytable import MAX_SIZE as MAX_SIZE
from kvtier.tiers.keytable import Entry as Entry
from kvtier.tiers.keytable import key_int as key_int


class CompactIndex(KeyTable):
    """What a persistent tier knows of its objects (see the module invariants)."""

    def __init__(self, initial: int = 1024) -> None:
        super().__init__(initial)
        self._head = self._tail = _NIL
        self._links = 0  # changes to the recency list: ``items`` resumes where it stopped
        self._any_placed = False  # some entry may wait for ``link_placed``
        #: Told each key that ``forget``/``forget_if`` dropped (after the lock is let go):
        #: the KV event stream (``kvtier.vllm.events``). Must only enqueue, never block.
        self.on_forget: Callable[[ChunkKey], None] | None = None

    # -- the recency list (lock held) ---------------------------------------------------
    def _unlink(self, e: int) -> None:
        self._links += 1
        p, n = int(self._prev[e]), int(self._next[e])
        if p in (_UNLINKED, _PLACED):
            return
        if p == _NIL:
            self._head = n
        else:
            self._next[p] = n
        if n == _NIL:
            self._tail = p
        else:
            self._prev[n] = p

    def _append(self, e: int) -> None:
        self._links += 1
        self._prev[e], self._next[e] = self._tail, _NIL
        if self._tail == _NIL:
            self._head = e
        else:
            self._next[self._tail] = e
        self._tail = e

    def _forget_at(self, cell: int, e: int) -> Entry:
        """Drop entry ``e`` (at table ``cell``): out of the list, its slot freed."""
        self._unlink(e)
        return self._free_entry(cell, e)

    # -- queries ------------------------------------------------------------------------
    def coldest(self, n: int, nbytes: int | None = None) -> list[tuple[ChunkKey, Entry]]:
        """Linked entries from the cold end: up to ``n``, and (given ``nbytes``) only as
        many as it takes to reach ``nbytes`` bytes."""
        out: list[tuple[ChunkKey, Entry]] = []
        left = nbytes
        with self._lock:
            e = self._head
            while e != _NIL and len(out) < n and (left is None or left > 0):
                entry = self._entry(e)
                out.append((self._key(e), entry))
                if left is not None:
                    left -= entry.size
                e = int(self._next[e])
        return out

    def items(self, batch: int = 4096) -> Iterator[tuple[ChunkKey, Entry]]:
        """Every entry (linked ones coldest first, then any not yet linked), in batches of
        one lock hold each; entries changed meanwhile may be seen twice or not at all."""
        seen = 0
        resume: tuple[int, int] | None = None  # (list changes, next entry) after a batch
        while True:
            chunk, resume = self._linked_after(seen, batch, resume)
            yield from chunk
            if len(chunk) < batch:
                break
            seen += batch
        with self._lock:
            prev = self._prev[: self._top]
            ids = np.nonzero((prev == _UNLINKED) | (prev == _PLACED))[0].tolist()
        for i in range(0, len(ids), batch):
            with self._lock:
                got = [(self._key(e), self._entry(e)) for e in ids[i : i + batch]
                       if int(self._prev[e]) in (_UNLINKED, _PLACED)]
            yield from got

    def _linked_after(
        self, skip: int, n: int, resume: tuple[int, int] | None = None,
    ) -> tuple[list[tuple[ChunkKey, Entry]], tuple[int, int]]:
        """Up to ``n`` linked entries after the first ``skip``; and where the next batch
        starts. With ``resume`` from the previous batch and no change to the list since,
        the walk starts there (``kvtier ls`` is linear, not quadratic, in the objects);
        else it walks ``skip`` entries from the coldest."""
        with self._lock:
            out: list[tuple[ChunkKey, Entry]] = []
            if resume is not None and resume[0] == self._links:
                e, i = resume[1], skip
            else:
                e, i = self._head, 0
            while e != _NIL and len(out) < n:
                if i >= skip:
                    out.append((self._key(e), self._entry(e)))
                i += 1
                e = int(self._next[e])
            return out, (self._links, e)

    # -- changes ------------------------------------------------------------------------
    def remember(
        self, key: ChunkKey, size: int, last_used: float, touched: float | None = None
    ) -> None:
        """Record ``key`` as the most recently used object (``touched``: None keeps it)."""
        k0, k1 = split(key)
        with self._lock:
            self._reserve()
            cell, e = self._find(k0, k1)
            if e < 0:
                e = self._insert(cell, k0, k1)
            else:
                self._unlink(e)
            self._set(e, size, last_used, touched)
            self._append(e)

    def remember_placed(self, key: ChunkKey, size: int, last_used: float,
                        seen: Entry | None = None) -> bool:
        """Record ``key`` (``touched`` kept) to be placed by ``last_used``, not at the hot
        end: it stays unlinked (found by lookups, not yet by ``coldest``) until
        ``link_placed``. Without ``seen`` only a key not known yet is recorded; with it,
        only while the key's entry is still ``seen``. Returns whether it recorded."""
        k0, k1 = split(key)
        with self._lock:
            self._reserve()
            cell, e = self._find(k0, k1)
            if e < 0:
                if seen is not None:
                    return False
                e = self._insert(cell, k0, k1)
            elif seen is None or int(self._version[e]) != seen.version:
                return False
            else:
                self._unlink(e)
            self._set(e, size, last_used, None)
            self._prev[e], self._next[e] = _PLACED, _NIL
            self._any_placed = True
            return True

    def link_placed(self) -> int:
        """Link the entries ``remember_placed`` recorded where their recency belongs
        (see the module invariants); returns how many."""
        with self._lock:
            if not self._any_placed:
                return 0
            self._any_placed = False
            top, prev, used, version = self._top, self._prev, self._used, self._version
            ids = np.nonzero(prev[:top] == _PLACED)[0].astype(np.int32)
            if not len(ids):
                return 0
            order = ids[np.lexsort((version[ids], used[ids]))]
            if self._tail != _NIL and used[order[0]] < used[self._tail]:
                live = prev[:top]
                ids_all = np.nonzero((live != _FREE) & (live != _UNLINKED))[0].astype(np.int32)
                chain = ids_all[np.lexsort((version[ids_all], used[ids_all]))]
                self._head = self._tail = _NIL
            else:
                chain = order
            self._links += 1
            self._prev[chain[1:]] = chain[:-1]
            self._next[chain[:-1]] = chain[1:]
            first, last = int(chain[0]), int(chain[-1])
            self._prev[first] = self._tail
            if self._tail == _NIL:
                self._head = first
            else:
                self._next[self._tail] = first
            self._next[last] = _NIL
            self._tail = last
            return len(ids)

    def add_scanned(self, found: Iterable[tuple[ChunkKey, int, float]]) -> int:
        """Add ``(key, size, last_used)`` of a start scan, unlinked (``finish_scan`` links
        them); a key already known is left as it is (this node recorded it since). Returns
        how many were added. Callers pass batches: one lock hold per call."""
        n = 0
        with self._lock:
            for key, size, last_used in found:
                k0, k1 = split(key)
                self._reserve()
                cell, e = self._find(k0, k1)
                if e >= 0:
                    continue
                e = self._insert(cell, k0, k1)
                self._set(e, size, last_used, None)
                self._prev[e], self._next[e] = _UNLINKED, _NIL
                n += 1
        return n

    def finish_scan(self) -> int:
        """Link every scanned entry at the cold end, coldest first; returns how many. The
        sort runs outside the lock; under it, one vectorised splice."""
        with self._lock:
            prev, used, top = self._prev, self._used, self._top
        ids = np.nonzero(prev[:top] == _UNLINKED)[0].astype(np.int32)
        order = ids[np.argsort(used[ids], kind="stable")]
        with self._lock:
            chain = order[self._prev[order] == _UNLINKED]
            if not len(chain):
                return 0
            self._links += 1
            self._next[chain[:-1]] = chain[1:]
            self._prev[chain[1:]] = chain[:-1]
            first, last = int(chain[0]), int(chain[-1])
            self._prev[first] = _NIL
            self._next[last] = self._head
            if self._head == _NIL:
                self._tail = last
            else:
                self._prev[self._head] = last
            self._head = first
            return len(chain)

    def forget(self, key: ChunkKey) -> Entry | None:
        """Drop ``key``; its entry, if there was one."""
        k0, k1 = split(key)
        with self._lock:
            cell, e = self._find(k0, k1)
            if e < 0:
                return None
            entry = self._forget_at(cell, e)
        if self.on_forget is not None:
            self.on_forget(key)
        return entry

    def forget_if(self, key: ChunkKey, seen: Entry) -> bool:
        """Drop ``key`` only if its entry is still ``seen`` (nothing recorded since)."""
        k0, k1 = split(key)
        with self._lock:
            cell, e = self._find(k0, k1)
            if e < 0 or int(self._version[e]) != seen.version:
                return False
            self._forget_at(cell, e)
        if self.on_forget is not None:
            self.on_forget(key)
        return True

    def replace_if(self, key: ChunkKey, seen: Entry, size: int, last_used: float) -> bool:
        """``remember`` (keeping ``touched``) only if the entry of ``key`` is still ``seen``."""
        k0, k1 = split(key)
        with self._lock:
            e = self._find(k0, k1)[1]
            if e < 0 or int(self._version[e]) != seen.version:
                return False
            self._unlink(e)
            self._set(e, size, last_used, None)
            self._append(e)
            return True

    def touch(self, key: ChunkKey, last_used: float) -> None:
        """This node used ``key`` (without writing the shared stamp): most recent now."""
        k0, k1 = split(key)
        with self._lock:
            e = self._find(k0, k1)[1]
            if e >= 0:
                self._unlink(e)
                self._set(e, int(self._size[e]), last_used, None)
                self._append(e)
