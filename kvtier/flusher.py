"""``IdleFlusher``: write dirty host chunks below while the engine has nothing to do, and
any chunk that has been dirty for longer than ``max_dirty_s`` whatever the engine does.

Why: under write-back, a chunk reaches the write-back tiers only when the host pool needs
its slot (a spill). Everything still dirty when the process ends is lost, and vLLM's API
server, with its default ``--shutdown-timeout 0``, kills the engine core right after
SIGTERM: the connector's shutdown flush never runs. Writing dirty chunks when the engine
is idle costs no extra bytes in the long run (write-back writes every chunk it evicts
anyway) and no serving time (the engine is idle, and the flush uses the store queue,
behind loads), and it leaves almost nothing dirty when a drained server is stopped.

A busy engine is never idle, so the idle flush alone leaves a stop at a busy moment
losing everything dirty. ``max_dirty_s`` bounds that, as the kernel's
``dirty_expire_centisecs`` bounds dirty pages: every tick, chunks dirty for longer are
queued below, busy or not, behind loads (the IO pool runs loads first) and into at most
half of the store queue's free room (spills and write-throughs keep the rest). A stop at
any moment then loses at most the last ``max_dirty_s`` seconds of chunks (plus whatever
the store queue could not take). The cost: a chunk that would have stayed dirty in host
memory until it was evicted (or overwritten by nothing) is written earlier; a chunk
that is evicted later is then clean and costs nothing more, so extra bytes are only those
of chunks that would never have been written at all (see README, "What survives a stop").

Threads: ``busy`` is called on vLLM's scheduler thread (each engine step; memory only).
``tick`` runs on the flusher's own thread (or a test's); it only queues store jobs, never
waits on storage. Time comes from the injected ``Clock``; tests call ``tick`` directly.
"""

from __future__ import annotations

import logging
import threading

from kvtier.clock import SYSTEM_CLOCK, Clock
from kvtier.store import FlushReport, TieredStore, WritePolicy

log = logging.getLogger("kvtier.store")


class IdleFlusher:
    def __init__(
        self,
        store: TieredStore,
        idle_s: float,
        *,
        max_dirty_s: float = 0.0,
        stop_budget_s: float = 0.0,
        batch: int = 8,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        """``idle_s``: flush once idle this long (0: never for idleness); ``max_dirty_s``:
        flush chunks dirty for longer, busy or not (0: no bound); ``stop_budget_s``: how
        long the flush that a stop signal starts may take (``request_stop``)."""
        if idle_s < 0 or max_dirty_s < 0 or stop_budget_s < 0:
            raise ValueError(f"idle_s ({idle_s}), max_dirty_s ({max_dirty_s}) and "
                             f"stop_budget_s ({stop_budget_s}) must be >= 0")
        self.store = store
        self.idle_s = idle_s
        self.max_dirty_s = max_dirty_s
        self.stop_budget_s = stop_budget_s
        self._stop_flag = False  # set from a signal handler: a plain store, no lock
        self._stop_started: float | None = None
        self.stop_flushed = threading.Event()  # the stop flush ran (or had nothing to do)
        self.stop_report: FlushReport | None = None
        self.batch = batch
        self.clock = clock
        self._last_busy = clock.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.queued = 0
        self.aged = 0  # of which queued because they were dirty for max_dirty_s

    def busy(self) -> None:
        """The engine did work now (scheduler thread)."""
        self._last_busy = self.clock.monotonic()

    def request_stop(self) -> None:
        """A stop signal arrived: the flusher's thread writes every dirty chunk below and
        waits for queued writes, within ``stop_budget_s``. Safe in a signal handler (one
        attribute store; no lock, no I/O)."""
        self._stop_flag = True

    def stop_flush_pending(self) -> bool:
        """A stop was requested and its flush has neither finished nor run out of time.
        Memory only (vLLM's scheduler thread: ``has_pending_push_work``)."""
        if not self._stop_flag or self.stop_flushed.is_set():
            return False
        started = self._stop_started
        return started is None or self.clock.monotonic() - started < self.stop_budget_s

    def stop_flush(self) -> FlushReport:
        """The flush a stop signal asks for: dirty chunks most recent first, then every
        queued write, within ``stop_budget_s`` of the request. Runs on the flusher's
        thread (or a test's)."""
        if self._stop_started is None:
            self._stop_started = self.clock.monotonic()
        t0 = self._stop_started
        try:
            left_s = max(0.0, self.stop_budget_s - (self.clock.monotonic() - t0))
            report = self.store.flush_dirty(left_s, self.clock)
            self.store.flush(max(0.0, self.stop_budget_s - (self.clock.monotonic() - t0)))
        finally:
            self.stop_flushed.set()  # never hold vLLM's loop up on a flush that raised
        self.stop_report = report
        log.info("kvtier: stop signal: wrote %d dirty chunks below in %.2f s, %d left",
                 report.flushed, report.seconds, report.left)
        return report

    def stop_deadline_left(self, budget_s: float) -> float:
        """Of ``budget_s`` counted from the stop signal's flush (or from now if none
        started), the seconds left: a shutdown after a stop flush gets one budget in all."""
        started = self._stop_started
        if started is None:
            return budget_s
        return max(0.0, budget_s - (self.clock.monotonic() - started))

    def tick(self) -> int:
        """Queue chunks dirty for ``max_dirty_s`` (busy or not, into half the store
        queue's free room), then, if the engine has been idle for ``idle_s`` and the store
        queue is empty, a batch of any dirty chunks. Returns how many were queued."""
        n = 0
        room = self.store.free_store_slots(WritePolicy.BACK) // 2
        if self.max_dirty_s > 0 and room and self.store.can_write_back():
            cutoff = self.store.host.clock.monotonic() - self.max_dirty_s
            aged = self.store.write_back_some(room, older_than=cutoff)
            self.aged += aged
            n += aged
        idle = self.idle_s > 0 and self.clock.monotonic() - self._last_busy >= self.idle_s
        if idle and not self.store.queued_stores():  # earlier writes first: no backlog
            n += self.store.write_back_some(self.batch)
        self.queued += n
        return n

    def start(self, interval_s: float = 0.2) -> IdleFlusher:
        def run() -> None:
            while not self._stop.wait(interval_s):
                try:
                    if self._stop_flag and not self.stop_flushed.is_set():
                        self.stop_flush()
                    else:
                        self.tick()
                except Exception:  # a flush is best effort; the next tick tries again
                    log.exception("kvtier: idle flush failed")

        self._thread = threading.Thread(target=run, name="kvtier-idle-flush", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread; waits for it at most ``timeout`` seconds (a stop flush it is
        running goes on to its own budget; it is a daemon)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout)
