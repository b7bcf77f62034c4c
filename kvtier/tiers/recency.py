"""``RecencyIndex``: what a persistent tier (file, S3) knows of its objects in memory;
``TempIndex``: what the file tier knows of temp files (writes in flight or abandoned).

Invariants: entries are ordered coldest first; ``bytes`` is always the sum of their
sizes; every method is atomic. ``lock`` is re-entrant, so a caller can make a compound
decision (look, then change) atomically with it held. No I/O happens here: the tiers do
their stat/HEAD calls outside the lock and record the result.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from kvtier.keys import ChunkKey
from kvtier.tiers.base import TierUsage


@dataclass
class Entry:
    size: int
    last_used: float  # recency used for ordering
    touched: float = float("-inf")  # when this node last wrote recency (S3 rate limit)


class RecencyIndex:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._entries: OrderedDict[ChunkKey, Entry] = OrderedDict()
        self.bytes = 0

    def reset(self, found: Iterable[tuple[float, ChunkKey, int]]) -> None:
        """Replace everything with ``(last_used, key, size)`` triples (any order)."""
        ordered = sorted(found)
        with self.lock:
            self._entries = OrderedDict((k, Entry(size, used)) for used, k, size in ordered)
            self.bytes = sum(e.size for e in self._entries.values())

    def forget(self, key: ChunkKey) -> None:
        with self.lock:
            e = self._entries.pop(key, None)
            if e is not None:
                self.bytes -= e.size

    def remember(
        self, key: ChunkKey, size: int, last_used: float, touched: float = float("-inf")
    ) -> None:
        """Record ``key`` as the most recently used object."""
        with self.lock:
            self.forget(key)
            self._entries[key] = Entry(size, last_used, touched)
            self.bytes += size

    def get(self, key: ChunkKey) -> Entry | None:
        with self.lock:
            return self._entries.get(key)

    def refresh(self, key: ChunkKey) -> None:
        """Make ``key`` the most recently used without changing its entry."""
        with self.lock:
            if key in self._entries:
                self._entries.move_to_end(key)

    def items(self) -> list[tuple[ChunkKey, Entry]]:
        """A snapshot, coldest first."""
        with self.lock:
            return list(self._entries.items())

    def usage(self, capacity: int) -> TierUsage:
        with self.lock:
            return TierUsage(len(self._entries), self.bytes, capacity)

    def __contains__(self, key: object) -> bool:
        with self.lock:
            return key in self._entries

    def __len__(self) -> int:
        with self.lock:
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
