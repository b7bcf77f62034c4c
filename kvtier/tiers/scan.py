"""The start scan of an object tier: the whole store listed once, a page at a time, into
the tier's ``CompactIndex``, on one thread or on several.

A transport splits a pass into slices that can be listed independently
(``Transport.slices``: the first cursor of each, in key order). A file tier has 257: its
256 top-level directories and the files directly in ``kv/``; an S3 prefix has one (a
listing continues from a token only its previous page gives). Slice ``i`` is listed page
by page from its cursor until a page whose next cursor is slice ``i + 1``'s first (or
``None``, the end of the pass).

Invariants:

* ``threads`` workers (at most one per slice) take slices in order from one shared
  counter, so a slow slice holds up only the worker listing it. Worker 0 is the calling
  thread; the others are ``<tier>-index-<i>`` threads, joined before ``run`` returns.
  With one thread this is exactly the plain pass, page after page from ``None``.
* Every page's objects go to ``CompactIndex.add_scanned`` in batches of ``BATCH`` (one
  index lock hold each), whichever worker listed them: a key the index already holds (a
  put or probe that raced the scan) is left as it is. Scanned entries are linked by
  recency afterwards (``finish_scan``, the caller's), so the order in which workers add
  pages changes nothing the index keeps.
* ``progress(n)`` is called after each page with the objects listed so far by all
  workers, under the scan's lock: the numbers it sees never go down.
* ``rate`` (objects per second, 0: no limit) is counted over all workers from the scan's
  start: before each page a worker waits until the objects listed so far are at most
  ``rate`` per second (``scan_delay``). Pages are whole, so a burst is one page per
  worker. ``stop`` (the tier's close) ends every wait at once, and each worker stops
  before its next page.
* A fault (any exception) of a listing stops the scan: its worker ends, the others end
  before their next page, and ``run`` returns the first fault with the objects listed.
  The caller's walk finds what the scan did not reach.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.tiers.compact import CompactIndex
from kvtier.tiers.transport import Transport

#: Scanned entries added per index lock hold.
BATCH = 512


def scan_delay(listed: int, elapsed: float, rate: float) -> float:
    """Seconds a start scan that has listed ``listed`` objects in ``elapsed`` seconds
    waits before its next page to list at most ``rate`` objects a second (0: none)."""
    if rate <= 0:
        return 0.0
    return max(0.0, listed / rate - elapsed)


@dataclass(frozen=True)
class Scanned:
    """What a start scan did."""

    objects: int  # listed (a key listed twice, or already known, counts each time)
    fault: Exception | None  # what stopped it before the end (None: the end, or ``stop``)


class StartScan:
    """One start scan of one store (see the module invariants); ``run`` it once."""

    def __init__(self, transport: Transport, index: CompactIndex, *, threads: int,
                 rate: float, stop: threading.Event, progress: Callable[[int], None],
                 name: str) -> None:
        self._transport = transport
        self._index = index
        self._threads = threads
        self._rate = rate
        self._stop = stop
        self._progress = progress
        self._name = name
        self._lock = threading.Lock()  # the counters below
        self._slices: Sequence[object | None] = ()
        self._next_slice = 0
        self._listed = 0
        self._fault: Exception | None = None
        self._start = 0.0

    def run(self) -> Scanned:
        """List the whole store into the index (or until a fault or ``stop``)."""
        self._slices = self._transport.slices()
        self._start = time.perf_counter()
        workers = [threading.Thread(target=self._work, name=f"{self._name}-index-{i}",
                                    daemon=True)
                   for i in range(1, min(self._threads, len(self._slices)))]
        for worker in workers:
            worker.start()
        self._work()
        for worker in workers:
            worker.join()
        return Scanned(self._listed, self._fault)

    def _take_slice(self) -> tuple[object | None, object | None] | None:
        """The next slice to list, as (first cursor, the next slice's); None: all taken,
        or the scan stopped on a fault."""
        with self._lock:
            i = self._next_slice
            if i >= len(self._slices) or self._fault is not None:
                return None
            self._next_slice += 1
        return self._slices[i], (self._slices[i + 1] if i + 1 < len(self._slices) else None)

    def _work(self) -> None:
        while (taken := self._take_slice()) is not None:
            cursor, end = taken
            while True:
                if self._stop.wait(self._delay()) or self._fault is not None:
                    return
                try:
                    page = self._transport.page(cursor)
                    objects = page.objects
                    for i in range(0, len(objects), BATCH):
                        self._index.add_scanned(objects[i : i + BATCH])
                except Exception as e:  # the scan stops; the walk finds the rest
                    with self._lock:
                        self._fault = self._fault or e
                    return
                with self._lock:
                    self._listed += len(objects)
                    self._progress(self._listed)
                if page.next is None or page.next == end:
                    break
                cursor = page.next

    def _delay(self) -> float:
        with self._lock:
            listed = self._listed
        return scan_delay(listed, time.perf_counter() - self._start, self._rate)
