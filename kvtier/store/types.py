"""The store's small value types: how a lower tier is written, what a lookup found, what a
load holds and how it is getting on, what a flush did.

No I/O, no locks of their own: a ``Lookup`` and a ``FlushReport`` are frozen; a
``LoadProgress`` is plain attribute stores (see its docstring for who writes what); a
``Held`` is released exactly once, from any thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple

import numpy as np

from kvtier.clock import SYSTEM_CLOCK, Clock
from kvtier.keys import ChunkKey
from kvtier.objformat import ChunkMeta
from kvtier.tiers.base import SharedTier
from kvtier.tiers.host import HostTier

HOST = 0  # tier index of the host tier in every Lookup


class WritePolicy(StrEnum):
    BACK = "back"
    THROUGH = "through"


@dataclass(frozen=True)
class LowerTier:
    tier: SharedTier
    write: WritePolicy


@dataclass(frozen=True)
class Lookup:
    """The stored prefix of a key list: ``tiers[i]`` holds ``keys[i]`` (0 = host)."""

    keys: tuple[ChunkKey, ...]
    tiers: tuple[int, ...]

    @property
    def hits(self) -> int:
        return len(self.keys)

    def head(self, n: int) -> Lookup:
        """The first ``n`` entries."""
        return Lookup(self.keys[:n], self.tiers[:n])


@dataclass(frozen=True)
class FlushReport:
    """What a bounded flush of dirty host chunks did."""

    flushed: int
    left: int
    seconds: float


class LoadProgress:
    """How a ``load`` is getting on, for a caller that gives up on it (a deadline).

    ``touch`` is called on the IO thread after each chunk; ``idle_for`` may be read from
    any thread; ``cancel`` (any thread) makes the load stop before its next chunk. Plain
    attribute stores: no lock.

    ``stages`` is where the load spent its time (wall seconds by ``RESTORE_STAGES`` name:
    ``queue``, ``settle``, ``slot``, ``read``), added to by the IO thread running the
    load (``waited``); read it once the load's future is done.

    ``tiers``: the lower tiers (``Lookup`` indices) the load or probe may wait on, set by
    the store when it takes the job (``TieredStore.stalled`` asks their breakers)."""

    def __init__(self, clock: Clock = SYSTEM_CLOCK) -> None:
        self.clock = clock
        self.last = clock.monotonic()
        self.cancelled = False
        self.stages: dict[str, float] = {}
        self.tiers: frozenset[int] = frozenset()
        self._on_cancel: list[Callable[[], object]] = []
        self._hooks_lock = threading.Lock()  # the hooks only; the rest is plain stores

    def touch(self) -> None:
        self.last = self.clock.monotonic()

    def waited(self, stage: str, seconds: float) -> None:
        """Add ``seconds`` to ``stage`` (the IO thread running the load)."""
        self.stages[stage] = self.stages.get(stage, 0.0) + seconds

    def idle_for(self) -> float:
        return self.clock.monotonic() - self.last

    def cancel(self) -> None:
        """Stop the load (any thread): it reads no further chunk, and a part of it still
        queued on an IO pool is cancelled there (``on_cancel``), which releases the host
        slots it held: a load queued behind a hung tier pins nothing once abandoned."""
        with self._hooks_lock:
            self.cancelled = True
            hooks, self._on_cancel = self._on_cancel, []
        for hook in hooks:
            hook()

    def on_cancel(self, hook: Callable[[], object]) -> None:
        """Run ``hook`` when the load is cancelled (at once if it is already)."""
        with self._hooks_lock:
            if not self.cancelled:
                self._on_cancel.append(hook)
                return
        hook()


class Hit(NamedTuple):
    """A host slot held for reading, the chunk in it, and the tier it was read from."""

    slot: int
    meta: ChunkMeta
    tier: int


@dataclass
class Held:
    """Host slots held for reading (never evicted meanwhile), in key order: ``slots`` are
    ``(slot, meta)``, ``from_tier[i]`` the tier ``slots[i]`` was read from. Release
    exactly once, from any thread."""

    host: HostTier
    slots: list[tuple[int, ChunkMeta]] = field(default_factory=list)
    from_tier: list[int] = field(default_factory=list)

    def add(self, hit: Hit) -> None:
        self.slots.append((hit.slot, hit.meta))
        self.from_tier.append(hit.tier)

    def view(self, i: int) -> np.ndarray:
        slot, meta = self.slots[i]
        return self.host.view(slot, meta.payload_len)

    def release(self) -> None:
        for slot, _ in self.slots:
            self.host.release(slot)
        self.slots = []

    def __len__(self) -> int:
        return len(self.slots)
