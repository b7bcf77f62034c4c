"""Eviction policies. A policy sees keys only, never bytes, slots or files.

``evict(n, can_evict)`` is atomic: it either removes and returns exactly ``n`` keys that
``can_evict`` accepted, least valuable first, or returns ``None`` and changes nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Protocol

from kvtier.keys import ChunkKey


class EvictionPolicy(Protocol):
    def insert(self, key: ChunkKey, *, cold: bool = False) -> None:
        """Add ``key`` as the most valuable key, or with ``cold`` the least."""
        ...


    def touch(self, key: ChunkKey) -> None: ...

    def forget(self, key: ChunkKey) -> None: ...

    def evict(self, n: int, can_evict: Callable[[ChunkKey], bool]) -> list[ChunkKey] | None: ...

    def coldest(self) -> Iterator[ChunkKey]:
        """Keys from least to most valuable, without changing anything."""
        ...

    def coldest_key(self) -> ChunkKey | None:
        """The least valuable key, in O(1); None if empty."""
        ...

    def __len__(self) -> int: ...


class LRUPolicy:
    """Least recently used first. ``touch`` on every hit refreshes recency."""

    def __init__(self) -> None:
        self._order: OrderedDict[ChunkKey, None] = OrderedDict()

    def insert(self, key: ChunkKey, *, cold: bool = False) -> None:
        self._order[key] = None
        self._order.move_to_end(key, last=not cold)

    def touch(self, key: ChunkKey) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def forget(self, key: ChunkKey) -> None:
        self._order.pop(key, None)

    def evict(self, n: int, can_evict: Callable[[ChunkKey], bool]) -> list[ChunkKey] | None:
        victims: list[ChunkKey] = []
        for key in self._order:
            if len(victims) == n:
                break
            if can_evict(key):
                victims.append(key)
        if len(victims) < n:
            return None
        for key in victims:
            del self._order[key]
        return victims

    def coldest(self) -> Iterator[ChunkKey]:
        return iter(list(self._order))

    def coldest_key(self) -> ChunkKey | None:
        return next(iter(self._order), None)

    def __len__(self) -> int:
        return len(self._order)
