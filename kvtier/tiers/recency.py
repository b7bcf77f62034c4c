"""``RecencyIndex``: what a persistent tier (file, S3) knows of its objects in memory;
``TempIndex``: what the file tier knows of temp files (writes in flight or abandoned).

Invariants:

* Entries are ordered coldest first; ``bytes`` is always the sum of their sizes.
* Every method is atomic, and the lock is private: no caller can hold it across a call of
  its own. No I/O (file system, network, logging) ever happens under it, so a lookup on
  vLLM's scheduler thread waits at most for another thread's in-memory update, never for
  a ``stat``, ``unlink``, HEAD or DELETE. The tiers do their I/O outside and record the
  result.
* ``Entry`` is immutable and every change (a ``refresh`` too) stores a new one, so an
  entry read earlier is a version: ``forget_if``/``replace_if`` change the index only if
  nobody recorded anything for the key since. That is how a collector, which decides on a
  snapshot and then does its I/O unlocked, leaves alone what this node wrote, read or
  renewed meanwhile.
* Any thread may call any method.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from kvtier.keys import ChunkKey
from kvtier.tiers.base import TierUsage


@dataclass(frozen=True)
class Entry:
    size: int
    last_used: float  # recency used for ordering
    touched: float = float("-inf")  # when this node last wrote recency (S3 rate limit)


class RecencyIndex:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: OrderedDict[ChunkKey, Entry] = OrderedDict()
        self.bytes = 0

    def reset(self, found: Iterable[tuple[float, ChunkKey, int]]) -> None:
        """Replace everything with ``(last_used, key, size)`` triples (any order)."""
        ordered = sorted(found)
        entries = OrderedDict((k, Entry(size, used)) for used, k, size in ordered)
        total = sum(e.size for e in entries.values())
        with self._lock:
            self._entries, self.bytes = entries, total

    def _pop(self, key: ChunkKey) -> Entry | None:
        e = self._entries.pop(key, None)
        if e is not None:
            self.bytes -= e.size
        return e

    def _put(self, key: ChunkKey, entry: Entry) -> None:
        self._pop(key)
        self._entries[key] = entry
        self.bytes += entry.size

    def forget(self, key: ChunkKey) -> Entry | None:
        """Drop ``key``; its entry, if there was one."""
        with self._lock:
            return self._pop(key)

    def forget_if(self, key: ChunkKey, seen: Entry) -> bool:
        """Drop ``key`` only if its entry is still ``seen`` (nothing recorded since)."""
        with self._lock:
            if self._entries.get(key) is not seen:
                return False
            self._pop(key)
            return True

    def remember(
        self, key: ChunkKey, size: int, last_used: float, touched: float = float("-inf")
    ) -> None:
        """Record ``key`` as the most recently used object."""
        with self._lock:
            self._put(key, Entry(size, last_used, touched))

    def replace_if(self, key: ChunkKey, seen: Entry, size: int, last_used: float) -> bool:
        """``remember`` only if the entry of ``key`` is still ``seen``."""
        with self._lock:
            if self._entries.get(key) is not seen:
                return False
            self._put(key, Entry(size, last_used, seen.touched))
            return True

    def use(self, key: ChunkKey, last_used: float) -> None:
        """This node used ``key`` (without writing the shared stamp): most recent now."""
        with self._lock:
            e = self._entries.get(key)
            if e is not None:
                self._put(key, Entry(e.size, last_used, e.touched))

    def get(self, key: ChunkKey) -> Entry | None:
        with self._lock:
            return self._entries.get(key)

    def refresh(self, key: ChunkKey) -> None:
        """This node used ``key``: most recent now, its recency unchanged (a new version
        of the same values, so a collector that chose it keeps it)."""
        with self._lock:
            e = self._entries.get(key)
            if e is not None:
                self._put(key, Entry(e.size, e.last_used, e.touched))

    def items(self) -> list[tuple[ChunkKey, Entry]]:
        """A snapshot, coldest first."""
        with self._lock:
            return list(self._entries.items())

    def usage(self, capacity: int) -> TierUsage:
        with self._lock:
            return TierUsage(len(self._entries), self.bytes, capacity)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


@dataclass(frozen=True)
class TempEntry:
    size: int
    mtime: float  # the last write to it, as the file system reports it


class TempIndex:
    """Temp files seen in a shared directory, any node's. They hold disk space, so the
    tier counts their bytes against capacity until they are published or removed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, TempEntry] = {}
        self.bytes = 0

    def reset(self, found: Iterable[tuple[str, int, float]]) -> None:
        """Replace everything with ``(path, size, mtime)`` triples."""
        with self._lock:
            self._entries = {path: TempEntry(size, mtime) for path, size, mtime in found}
            self.bytes = sum(e.size for e in self._entries.values())

    def remember(self, path: str, size: int, mtime: float) -> None:
        with self._lock:
            old = self._entries.get(path)
            self.bytes += size - (old.size if old is not None else 0)
            self._entries[path] = TempEntry(size, mtime)

    def forget(self, path: str) -> None:
        with self._lock:
            old = self._entries.pop(path, None)
            if old is not None:
                self.bytes -= old.size

    def items(self) -> list[tuple[str, TempEntry]]:
        with self._lock:
            return list(self._entries.items())

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
