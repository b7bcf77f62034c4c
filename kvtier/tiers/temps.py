"""``TempIndex``: the temp files (writes in flight, or abandoned) a file tier has seen in
its shared directory, any node's. They hold disk space, so the tier counts their bytes
against capacity until they are published or removed.

Temps are grouped by the leaf directory that holds them (a number, ``FileTransport``'s
page order), so a page of the walk replaces exactly the temps of the leaves it listed,
at a cost that grows with the leaves holding temps, not with every temp known.

Invariants: ``bytes`` is the sum of the sizes of the entries held. Any thread may call
any method; nothing under the lock does I/O.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class TempEntry:
    size: int
    mtime: float  # the last write to it, as the file system reports it
    group: int  # the leaf directory holding it


class TempIndex:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, TempEntry] = {}
        self._groups: dict[int, set[str]] = {}
        self.bytes = 0

    def reset(self, first: int, last: int,
              found: Iterable[tuple[int, str, int, float]]) -> None:
        """Replace the temps of groups ``first..last`` by ``found``'s ``(group, path, size,
        mtime)`` (each group in that range)."""
        with self._lock:
            for group in [g for g in self._groups if first <= g <= last]:
                for path in self._groups.pop(group):
                    self.bytes -= self._entries.pop(path).size
            for group, path, size, mtime in found:
                self._put(path, TempEntry(size, mtime, group))

    def update(self, path: str, size: int, mtime: float) -> None:
        """A known temp's new size and mtime (nothing if it was forgotten meanwhile)."""
        with self._lock:
            old = self._entries.get(path)
            if old is not None:
                self._put(path, TempEntry(size, mtime, old.group))

    def _put(self, path: str, entry: TempEntry) -> None:
        self._drop(path)
        self._entries[path] = entry
        self._groups.setdefault(entry.group, set()).add(path)
        self.bytes += entry.size

    def _drop(self, path: str) -> None:
        old = self._entries.pop(path, None)
        if old is None:
            return
        self.bytes -= old.size
        paths = self._groups[old.group]
        paths.discard(path)
        if not paths:
            del self._groups[old.group]

    def forget(self, path: str) -> None:
        with self._lock:
            self._drop(path)

    def items(self) -> list[tuple[str, TempEntry]]:
        with self._lock:
            return list(self._entries.items())

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
