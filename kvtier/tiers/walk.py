"""``Walk``: how an object tier keeps its index fresh a bounded slice at a time.

The walk lists the store page by page (``Transport.page``: one leaf directory, one S3
listing page), from a cursor it keeps between calls, and reconciles each page with the
tier's ``CompactIndex``. ``tick`` walks one bounded slice: a heartbeat's worth.

Invariants:

* **A tick is bounded.** It stops at the first page boundary after it has listed
  ``TickBudget.objects`` objects or spent ``TickBudget.seconds`` (the injected clock's
  ``monotonic``), or at the end of a pass. It overruns its time by at most one page (and
  whatever its caller does with that page). The next tick resumes at the next page, so a
  pass takes about ``pass cost / seconds`` ticks: ``last_pass`` says how many it took.
* **Reconciliation.** Each page's objects are taken at once: objects other nodes wrote
  are added, sizes and (exact listings) newer stamps taken; added and re-stamped entries
  take their place in the eviction order by that stamp at the tick's end (never at the
  hot end whatever their age). Dropping entries the store no
  longer has is a sweep over the index (``CompactIndex.in_range``, O(entries) numpy
  work), so it is batched: consecutive pages accumulate one key range, swept once
  ``SWEEP_OBJECTS`` were listed, at the end of a pass, and at the end of every tick. An
  entry in the swept range that none of its pages listed is dropped unless it was
  recorded after the listing that fixed the extent of a page it covers (its version is
  newer than the mark taken then): a put or probe racing the listing is never lost. A
  page that is not ``fresh`` got its extent from an earlier page's listing, carried in
  the cursor (a file tier reads a top-level directory's leaves once, when it enters it,
  maybe ticks before): its mark is the one taken before that earlier listing, so a put
  into a leaf created after it, which the page's range covers but did not list, stays.
* Not thread-safe: one caller at a time (``ObjectTier`` holds its collection lock). It
  does I/O (the listing) and never holds the index lock across it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvtier.clock import Clock
from kvtier.keys import ChunkKey
from kvtier.tiers.compact import CompactIndex
from kvtier.tiers.transport import Page, Transport

log = logging.getLogger("kvtier.walk")

#: Listed objects one sweep covers at most (one O(entries) numpy pass over the index each).
SWEEP_OBJECTS = 50_000


@dataclass(frozen=True)
class TickBudget:
    """What one tick may cost: listed objects, and seconds (whole pages either way)."""

    objects: int
    seconds: float

    def __post_init__(self) -> None:
        if self.objects < 1:
            raise ValueError(f"tick objects: must be >= 1, got {self.objects}")
        if not self.seconds > 0:
            raise ValueError(f"tick seconds: must be > 0, got {self.seconds}")


#: A whole pass at once (``rescan``, tools).
UNBOUNDED = TickBudget(1 << 62, math.inf)


@dataclass(frozen=True)
class PassStats:
    """One completed pass of the walk."""

    ticks: int  # ticks that walked some of it
    seconds: float  # time spent walking it (inside ticks), by the injected clock
    objects: int  # objects listed


def _older(a: int, b: int) -> bool:
    """Mark ``a`` was taken before mark ``b`` (modulo 2**32, as ``changed_since``)."""
    return 0 < ((b - a) & 0xFFFFFFFF) < (1 << 31)


class _Sweep:
    """Pages whose extents were listed after ``mark``, covering ``[lo, hi]``, and the
    keys they listed."""

    def __init__(self, mark: int) -> None:
        self.mark = mark
        self.lo: int | None = None
        self.hi = -1
        self.keys: set[ChunkKey] = set()

    def add(self, page: Page, extent_mark: int) -> None:
        """``extent_mark``: the index mark taken before the listing that fixed the page's
        extent (before this page's own listing if it is ``fresh``)."""
        if page.lo <= page.hi:  # an empty range (the top-files page) covers nothing
            self.lo = page.lo if self.lo is None else self.lo
            self.hi = page.hi
        if _older(extent_mark, self.mark):
            self.mark = extent_mark
        self.keys.update(obj.key for obj in page.objects)


class Walk:
    """The walk of one tier (see the module invariants)."""

    def __init__(self, transport: Transport, index: CompactIndex, clock: Clock,
                 on_fault: Callable[[str, Exception], None], *, name: str) -> None:
        self._transport = transport
        self._index = index
        self._clock = clock
        self._on_fault = on_fault
        self._name = name
        self._cursor: object | None = None  # the next page
        #: The index mark taken before the listing that fixed the cursor's extent (a
        #: fresh page's own listing; carried while pages are not fresh).
        self._extent_mark: int | None = None
        #: Full passes completed (tests, benchmarks).
        self.passes = 0
        #: The last completed pass (None before the first).
        self.last_pass: PassStats | None = None
        self._ticks = self._objects = 0  # of the pass in progress
        self._seconds = 0.0

    def restart(self) -> None:
        """The next tick starts a pass from the first page."""
        self._cursor = None
        self._extent_mark = None
        self._ticks = self._objects = 0
        self._seconds = 0.0

    def tick(self, budget: TickBudget, op: str) -> Iterator[Page]:
        """Pages from the cursor, each reconciled with the index before it is yielded,
        until ``budget`` is spent or a pass ends. A listing fault ends the tick (reported
        as ``op``)."""
        start = self._clock.monotonic()
        listed = 0
        sweep = _Sweep(self._index.mark())  # before the first page is listed
        self._ticks += 1
        try:
            while True:
                mark = self._index.mark()
                try:
                    page = self._transport.page(self._cursor)
                except self._transport.faults as e:
                    self._on_fault(op, e)
                    return
                if page.fresh or self._extent_mark is None:
                    self._extent_mark = mark
                self._take(page)
                sweep.add(page, self._extent_mark)
                self._cursor = page.next
                listed += len(page.objects)
                self._objects += len(page.objects)
                yield page
                if page.next is None:
                    self._sweep(sweep)
                    self._end_pass(start)
                    start = self._clock.monotonic()
                    return
                if len(sweep.keys) >= SWEEP_OBJECTS:
                    self._sweep(sweep)
                if listed >= budget.objects or \
                        self._clock.monotonic() - start >= budget.seconds:
                    return
        finally:
            self._sweep(sweep)
            self._index.link_placed()
            self._seconds += self._clock.monotonic() - start

    def _take(self, page: Page) -> None:
        """Objects other nodes wrote, newer stamps (exact listings), sizes: placed by
        their recency (``CompactIndex.link_placed`` at the tick's end), never simply at
        the hot end."""
        exact = self._transport.exact_listing
        index = self._index
        for obj in page.objects:
            e = index.get(obj.key)
            if e is None:
                index.remember_placed(obj.key, obj.size, obj.used)
            elif (exact and obj.used > e.last_used + 1e-3) or obj.size != e.size:
                index.remember_placed(obj.key, obj.size,
                                      max(obj.used, e.last_used) if exact else e.last_used, e)

    def _sweep(self, sweep: _Sweep) -> None:
        """Drop entries of the swept range its pages did not list (unless recorded since
        its mark); the sweep is then empty, its mark the index's current one."""
        if sweep.lo is not None:
            for key, e in self._index.in_range(sweep.lo, sweep.hi):
                if key not in sweep.keys and not CompactIndex.changed_since(e, sweep.mark):
                    self._index.forget_if(key, e)
        sweep.lo, sweep.hi, sweep.keys = None, -1, set()
        sweep.mark = self._index.mark()

    def _end_pass(self, tick_start: float) -> None:
        seconds = self._seconds + self._clock.monotonic() - tick_start
        self.last_pass = PassStats(self._ticks, seconds, self._objects)
        self.passes += 1
        log.debug("%s: walk pass %d: %d objects in %d ticks, %.2f s walking", self._name,
                  self.passes, self._objects, self._ticks, seconds)
        self._ticks = self._objects = 0
        self._seconds = 0.0
