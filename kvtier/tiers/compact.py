"""``CompactIndex``: what a persistent tier (file, S3) knows of its objects, in 44 bytes an
entry plus an open-addressing table of 4-byte cells.

Layout (numpy arrays indexed by an entry id, a "slab"): the 16-byte key as two big-endian
``uint64`` halves, the size (``uint32`` bytes: objects are below 4 GiB, ``ObjectTier.put``
refuses larger ones), the recency (``float64`` wall seconds: exact, the collector compares
it with file mtimes and S3 stamps), when this node last wrote the shared stamp (``float32``
seconds after the first such write: only rate-limits restamps), a ``uint32`` version and
the ``int32`` links of a doubly linked list, coldest first. The table maps a mixed hash of
the key to an entry id with linear probing (tombstones on removal, rebuilt vectorised when
live and dead cells pass 70 %).

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
  batch can keep a waiter out for most of a second.
* ``key in index`` (vLLM's scheduler thread asks it, through ``ObjectTier.indexed``) takes
  no lock, so it never waits for a writer. It reads the table and the key arrays as they
  are: a table is swapped whole only after it is built, a cell goes from empty or deleted
  to an entry only after the entry's key is written, and every table keeps empty cells,
  so a probe run ends. A key present before the call and not removed during it is found;
  a key inserted or removed during the call may be answered either way (the index is a
  hint anyway: a hit is verified by its read, a miss is probed).
* Every change of an entry gives it a new version, drawn from one counter (``mark()``
  reads it). An ``Entry`` read earlier is a version: ``forget_if``/``replace_if`` change
  the index only if nobody recorded anything for the key since, and ``changed_since``
  says whether an entry was recorded after a mark (modulo 2**32: marks older than 2**31
  changes are not compared).
* Any thread may call any method.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from kvtier.keys import ChunkKey

_EMPTY, _TOMB = -1, -2  # table cells
_NIL, _UNLINKED, _FREE = -1, -2, -3  # _prev of: the head, a scanned entry, a free slot
_PLACED = -4  # _prev of an entry the walk found, waiting for ``link_placed``
_M64 = (1 << 64) - 1
_MIX = 0x9E3779B97F4A7C15
_MAX_LOAD = 0.7
MAX_SIZE = (1 << 32) - 1
#: Bytes of one slab entry (the table adds 4 bytes per cell).
ENTRY_BYTES = 8 + 8 + 4 + 8 + 4 + 4 + 4 + 4


@dataclass(frozen=True)
class Entry:
    size: int
    last_used: float  # recency used for ordering (wall seconds)
    touched: float  # when this node last wrote the shared stamp (-inf: never)
    version: int


def split(key: bytes) -> tuple[int, int]:
    return int.from_bytes(key[:8], "big"), int.from_bytes(key[8:16], "big")


def key_int(key: bytes) -> int:
    """The key as a 128-bit number: the order of its hex name, so of listings."""
    return int.from_bytes(key[:16], "big")


def _hash(k0: int, k1: int, bits: int) -> int:
    return (((k0 ^ ((k1 * 3) & _M64)) * _MIX) & _M64) >> (64 - bits)


def _hash_vec(k0: np.ndarray, k1: np.ndarray, bits: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        mixed = (k0 ^ (k1 * np.uint64(3))) * np.uint64(_MIX)
    return (mixed >> np.uint64(64 - bits)).astype(np.int64)


class CompactIndex:
    def __init__(self, initial: int = 1024) -> None:
        self._lock = threading.Lock()
        n = max(16, initial)
        self._k0 = np.zeros(n, np.uint64)
        self._k1 = np.zeros(n, np.uint64)
        self._size = np.zeros(n, np.uint32)
        self._used = np.zeros(n, np.float64)
        self._touched = np.full(n, -np.inf, np.float32)
        self._version = np.zeros(n, np.uint32)
        self._prev = np.full(n, _FREE, np.int32)
        self._next = np.full(n, _NIL, np.int32)
        self._top = 0  # slab slots ever handed out
        self._free = _NIL  # free slots, chained through _next
        self._bits = max(5, (2 * n - 1).bit_length())
        self._table = np.full(1 << self._bits, _EMPTY, np.int32)
        self._live = self._dead = 0
        self._head = self._tail = _NIL
        self._links = 0  # changes to the recency list: ``items`` resumes where it stopped
        self._any_placed = False  # some entry may wait for ``link_placed``
        self._tick = 0
        self._touch_base: float | None = None
        self.bytes = 0
        #: Told each key that ``forget``/``forget_if`` dropped (after the lock is let go):
        #: the KV event stream (``kvtier.vllm.events``). Must only enqueue, never block.
        self.on_forget: Callable[[ChunkKey], None] | None = None

    # -- internals (lock held) ----------------------------------------------------------
    def _find(self, k0: int, k1: int) -> tuple[int, int]:
        """``(cell, entry)``: the key's cell and entry id, or where to insert it and -1."""
        table, mask = self._table, (1 << self._bits) - 1
        pos, tomb = _hash(k0, k1, self._bits), -1
        while True:
            e = int(table[pos])
            if e == _EMPTY:
                return (tomb if tomb >= 0 else pos), -1
            if e == _TOMB:
                if tomb < 0:
                    tomb = pos
            elif int(self._k0[e]) == k0 and int(self._k1[e]) == k1:
                return pos, e
            pos = (pos + 1) & mask

    def _bump(self, e: int) -> None:
        self._tick = (self._tick + 1) & 0xFFFFFFFF
        self._version[e] = self._tick

    def _entry(self, e: int) -> Entry:
        t = float(self._touched[e])
        touched = t + self._touch_base if self._touch_base is not None else float("-inf")
        return Entry(int(self._size[e]), float(self._used[e]), touched, int(self._version[e]))

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

    def _alloc(self) -> int:
        if self._free != _NIL:
            e = self._free
            self._free = int(self._next[e])
            return e
        if self._top == len(self._k0):
            self._grow_slab(len(self._k0) * 5 // 4 + 16)  # NOTE: +25 %: bytes/object
        self._top += 1
        return self._top - 1

    def _grow_slab(self, n: int) -> None:
        def grown(a: np.ndarray, fill: float) -> np.ndarray:
            out = np.full(n, fill, a.dtype)
            out[: len(a)] = a
            return out

        self._k0, self._k1 = grown(self._k0, 0), grown(self._k1, 0)
        self._size, self._used = grown(self._size, 0), grown(self._used, 0)
        self._touched, self._version = grown(self._touched, -np.inf), grown(self._version, 0)
        self._prev, self._next = grown(self._prev, _FREE), grown(self._next, _NIL)

    def _rebuild(self) -> None:
        """A fresh table (no tombstones), at most half full. Vectorised linear probing:
        each round places, per empty cell, the first entry that wants it; the others step
        on. A cell once filled stays filled, so every probe run stays unbroken."""
        bits = max(5, int(np.ceil(np.log2(max(self._live, 1) / 0.5))))
        mask = (1 << bits) - 1
        table = np.full(1 << bits, _EMPTY, np.int32)
        ids = np.nonzero(self._prev[: self._top] != _FREE)[0].astype(np.int32)
        pos = _hash_vec(self._k0[ids], self._k1[ids], bits)
        while len(ids):
            empty = np.nonzero(table[pos] == _EMPTY)[0]
            cells, first = np.unique(pos[empty], return_index=True)
            won = empty[first]
            table[cells] = ids[won]
            keep = np.ones(len(ids), bool)
            keep[won] = False
            ids, pos = ids[keep], (pos[keep] + 1) & mask
        self._table, self._bits, self._dead = table, bits, 0

    def _insert(self, cell: int, k0: int, k1: int) -> int:
        e = self._alloc()
        self._k0[e], self._k1[e] = k0, k1
        if int(self._table[cell]) == _TOMB:
            self._dead -= 1
        self._table[cell] = e
        self._live += 1
        return e

    def _reserve(self) -> None:
        if self._live + self._dead + 1 > _MAX_LOAD * len(self._table):
            self._rebuild()

    def _set(self, e: int, size: int, last_used: float, touched: float | None) -> None:
        size = min(size, MAX_SIZE)
        self.bytes += size - int(self._size[e])
        self._size[e] = size
        self._used[e] = last_used
        if touched == float("-inf"):  # never stamped by this node (or a stamp undone)
            self._touched[e] = -np.inf
        elif touched is not None:
            if self._touch_base is None:
                self._touch_base = touched
            self._touched[e] = touched - self._touch_base
        self._bump(e)

    def _remove(self, cell: int, e: int) -> Entry:
        entry = self._entry(e)
        self._table[cell] = _TOMB
        self._dead += 1
        self._live -= 1
        self._unlink(e)
        self.bytes -= entry.size
        self._size[e], self._touched[e] = 0, -np.inf
        self._prev[e], self._next[e] = _FREE, self._free
        self._free = e
        return entry

    # -- queries ------------------------------------------------------------------------
    def get(self, key: ChunkKey) -> Entry | None:
        k0, k1 = split(key)
        with self._lock:
            e = self._find(k0, k1)[1]
            return None if e < 0 else self._entry(e)

    def __contains__(self, key: object) -> bool:
        """Lock-free (see the module invariants): the scheduler's question."""
        if not isinstance(key, bytes):
            return False
        k0, k1 = split(key)
        table = self._table  # one reference: a rebuild swaps in a whole new table
        mask = len(table) - 1
        pos = _hash(k0, k1, mask.bit_length())
        keys0, keys1 = self._k0, self._k1
        while True:
            e = int(table[pos])
            if e == _EMPTY:
                return False
            if e >= 0:
                while e >= len(keys0) or e >= len(keys1):  # grown after we read them
                    keys0, keys1 = self._k0, self._k1
                if int(keys0[e]) == k0 and int(keys1[e]) == k1:
                    return True
            pos = (pos + 1) & mask

    def __len__(self) -> int:
        with self._lock:
            return self._live

    def mark(self) -> int:
        """The version counter now: entries recorded later are ``changed_since`` it."""
        with self._lock:
            return self._tick

    @staticmethod
    def changed_since(entry: Entry, mark: int) -> bool:
        return 0 < ((entry.version - mark) & 0xFFFFFFFF) < (1 << 31)

    def nbytes(self) -> int:
        """Memory held by the arrays (allocated, whether used or not)."""
        with self._lock:
            arrays = (self._k0, self._k1, self._size, self._used, self._touched,
                      self._version, self._prev, self._next, self._table)
            return sum(a.nbytes for a in arrays)

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

    def _key(self, e: int) -> ChunkKey:
        return ChunkKey(int(self._k0[e]).to_bytes(8, "big") + int(self._k1[e]).to_bytes(8, "big"))

    def in_range(self, lo: int, hi: int) -> list[tuple[ChunkKey, Entry]]:
        """Entries whose key, as a number (``key_int``), is in ``[lo, hi]``. The candidates
        are found by a numpy pass over the keys' first halves outside the lock (O(n), a
        few ms per million entries) and each is confirmed under it."""
        with self._lock:
            k0, prev, top = self._k0, self._prev, self._top
        a0 = k0[:top]
        ids = np.nonzero((a0 >= np.uint64(lo >> 64)) & (a0 <= np.uint64(hi >> 64)))[0]
        ids = ids[prev[ids] != _FREE].tolist()
        out: list[tuple[ChunkKey, Entry]] = []
        for i in range(0, len(ids), 4096):  # one lock hold per batch
            with self._lock:
                for e in ids[i : i + 4096]:
                    if e < self._top and int(self._prev[e]) != _FREE:
                        key = self._key(e)
                        if lo <= key_int(key) <= hi:
                            out.append((key, self._entry(e)))
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
            entry = self._remove(cell, e)
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
            self._remove(cell, e)
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

    def use(self, key: ChunkKey, last_used: float) -> None:
        """This node used ``key`` (without writing the shared stamp): most recent now."""
        k0, k1 = split(key)
        with self._lock:
            e = self._find(k0, k1)[1]
            if e >= 0:
                self._unlink(e)
                self._set(e, int(self._size[e]), last_used, None)
                self._append(e)
