"""``Upkeep``: emptying the host tier (resets), writing dirty chunks back outside of
spills (idle and shutdown flushes), waiting for queued writes, and closing.

Threads and locks: ``StoreState``. ``drop_host``, ``empty_host`` and ``write_back_some``
only queue jobs (vLLM's scheduler thread, the idle flusher's thread); ``flush``,
``flush_dirty``, ``shutdown`` and ``close`` wait, each within its time bound (a stopping
engine's thread, tools, tests).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from kvtier.clock import SYSTEM_CLOCK, Clock
from kvtier.keys import ChunkKey
from kvtier.store.types import FlushReport
from kvtier.store.writeback import WriteBack

log = logging.getLogger("kvtier.store")


class Upkeep(WriteBack):
    # -- resets --------------------------------------------------------------------------
    def drop_host(self) -> int:
        """``reset_cache: weights``: empty the host tier of every unheld chunk, dirty ones
        included (never written below: KV computed before a weight sync may not be served
        after it); returns how many were dropped. Memory only, returns at once. Held chunks
        (being read or written below right now) stay until their holder is done; lower
        tiers are kept (other nodes and restarts share them)."""
        return self.host.delete([meta.key for _, meta in self.host.index.entries()])

    def empty_host(self) -> tuple[int, bool]:
        """``reset_cache: host`` (the weights never change in place; benchmarks use it to
        leave a prompt on the lower tiers only), memory only: drops every clean unheld
        chunk now and queues every dirty unheld one to the write-back tiers (it turns
        clean once written, and a later call drops it). Returns ``(dropped, empty)``;
        ``empty`` once the host tier holds nothing. Until then the caller reports the
        reset as not done, and vLLM's callers ask again, as they do while a save is in
        flight. A chunk a down tier cannot take stays, dirty: nothing stored is lost."""
        if self._back:
            self._write_back_batch(self.host.index.num_slots, frozenset())
        dirty = self.host.index.dirty_keys()
        dropped = self.host.delete(
            [meta.key for _, meta in self.host.index.entries() if meta.key not in dirty])
        return dropped, len(self.host.index) == 0

    # -- write-back outside of spills ------------------------------------------------------
    def write_back_some(self, max_n: int, *, older_than: float | None = None) -> int:
        """Queue up to ``max_n`` dirty chunks, most recently used first, to the write-back
        tiers without waiting (an idle engine's background flush; with ``older_than``, a
        ``host`` clock reading, only chunks dirty since before it: the bound on the age of
        dirty data). Each becomes clean once one write-back tier holds it; a write
        every such tier failed leaves it dirty. Returns how many were queued; a full store
        queue ends the batch."""
        return len(self._write_back_batch(max_n, frozenset(), older_than))

    def _write_back_batch(
        self, max_n: int, skip: Collection[ChunkKey], older_than: float | None = None
    ) -> dict[Future[Any], ChunkKey]:
        """Queue up to ``max_n`` dirty chunks not in ``skip``, most recently used first,
        to the write-back tiers; the futures queued, by key."""
        if not self._back:
            return {}
        jobs: dict[Future[Any], ChunkKey] = {}
        batch = self.host.index.take_dirty(max_n, hottest_first=True, skip=skip,
                                           older_than=older_than)
        for i, (slot, meta) in enumerate(batch):
            fut = self._queue_write_back(slot, meta, self._back, held=True,
                                         kind="write_back")
            if fut is None:  # the store queue is full: the rest stay dirty for later
                for rest, _ in batch[i + 1 :]:
                    self.host.release(rest)
                break
            jobs[fut] = meta.key
        return jobs

    def flush_dirty(self, budget_s: float, clock: Clock = SYSTEM_CLOCK) -> FlushReport:
        """Write dirty host chunks to the write-back tiers, most recently used first, for at
        most ``budget_s`` seconds (a clean shutdown: what comes back first is kept first).

        Chunks whose write failed stay dirty and count as left; a write that is still
        running at the deadline is abandoned to its IO thread (and counted as left).
        """
        t0 = clock.monotonic()
        deadline = t0 + budget_s
        flushed = 0
        failed: set[ChunkKey] = set()
        batch_n = max(1, self.io.num_threads * 2)
        while (left_s := deadline - clock.monotonic()) > 0:
            jobs = self._write_back_batch(batch_n, failed)
            if not jobs:
                # nothing could be queued: done, or every dirty chunk left is being
                # written by another job already (a spill), or the store queue is full
                if not self._inflight or not self.host.index.dirty_keys() - failed:
                    break
                wait(list(self._inflight), timeout=min(left_s, 0.5),
                     return_when=FIRST_COMPLETED)
                continue
            done, pending = wait(list(jobs), timeout=left_s)
            for fut in done:
                if not fut.cancelled() and fut.exception() is None and fut.result():
                    flushed += 1
                else:
                    failed.add(jobs[fut])
            if pending:
                break  # out of time
        left = len(self.host.index.dirty_keys())
        return FlushReport(flushed, left, clock.monotonic() - t0)

    # -- waiting and closing -------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued lower-tier write has finished, including those queued
        meanwhile (at most ``timeout`` seconds); True if none is left."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._inflight:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            wait(list(self._inflight), timeout=left)
        return not self._inflight

    def shutdown(self, budget_s: float, clock: Clock = SYSTEM_CLOCK) -> FlushReport:
        """A clean stop: flush dirty chunks (most recent first), finish queued writes, close.

        The whole call is bounded by ``budget_s``: a hung tier cannot hang the engine's
        shutdown; what was not written by then is logged as left (and lost, as a cache
        may lose entries: it costs a recompute after the restart).
        """
        deadline = clock.monotonic() + budget_s
        report = self.flush_dirty(budget_s, clock)
        drained = self.flush(max(0.0, deadline - clock.monotonic()))
        if report.flushed or report.left or not drained:
            log.info(
                "kvtier: shutdown wrote %d dirty chunks to the write-back tiers in %.2f s; "
                "%d dirty chunks left unwritten%s", report.flushed, report.seconds,
                report.left, "" if drained else "; queued writes abandoned at the deadline",
            )
        self.close(timeout=max(0.0, deadline - clock.monotonic()))
        return report

    def close(self, timeout: float | None = None) -> None:
        self.probe_io.close(0.0 if timeout is None else timeout)  # answers nobody awaits
        deadline = None if timeout is None else time.monotonic() + timeout
        for pool in self._distinct_pools():
            pool.close(None if deadline is None else max(0.0, deadline - time.monotonic()))
        for tier in self.tiers:
            tier.close()
