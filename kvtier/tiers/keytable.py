"""``KeyTable``: the storage under ``CompactIndex`` (``kvtier.tiers.compact``): a slab of
fixed-size entries in numpy arrays and an open-addressing table of 4-byte cells over it.

Layout (numpy arrays indexed by an entry id, a "slab"): the 16-byte key as two big-endian
``uint64`` halves, the size (``uint32`` bytes: objects are below 4 GiB, ``ObjectTier.put``
refuses larger ones), the recency (``float64`` wall seconds: exact, the collector compares
it with file mtimes and S3 stamps), when this node last wrote the shared stamp (``float32``
seconds after the first such write: only rate-limits restamps), a ``uint32`` version and
the ``int32`` links of the recency list that ``CompactIndex`` keeps (a free slot's
``_prev`` is ``_FREE``; its ``_next`` chains the free slots). The table maps a mixed hash
of the key to an entry id with linear probing (tombstones on removal, rebuilt vectorised
when live and dead cells pass 70 %).

Invariants:

* ``bytes`` is the sum of every live entry's size.
* Methods whose name starts with ``_`` run with ``_lock`` held (the caller's); the public
  ones take it themselves, and nothing under it does I/O.
* ``key in table`` takes no lock, so it never waits for a writer. It reads the table and
  the key arrays as they are: a table is swapped whole only after it is built, a cell
  goes from empty or deleted to an entry only after the entry's key is written, and every
  table keeps empty cells, so a probe run ends. A key present before the call and not
  removed during it is found; a key inserted or removed during the call may be answered
  either way (the index is a hint anyway: a hit is verified by its read, a miss is
  probed).
* Every change of an entry gives it a new version, drawn from one counter (``mark()``
  reads it); ``changed_since`` says whether an entry was recorded after a mark (modulo
  2**32: marks older than 2**31 changes are not compared).
"""


from __future__ import annotations

import threading
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


class KeyTable:
    """Keys, sizes, recency stamps and versions of a persistent tier's objects: see the
    module invariants. ``CompactIndex`` adds the recency list."""

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
        self._tick = 0
        self._touch_base: float | None = None
        self.bytes = 0

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

    def _free_entry(self, cell: int, e: int) -> Entry:
        """Drop entry ``e`` (at table ``cell``; already out of the recency list): a
        tombstone in its cell, its slot on the free chain. Returns what it held."""
        entry = self._entry(e)
        self._table[cell] = _TOMB
        self._dead += 1
        self._live -= 1
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
