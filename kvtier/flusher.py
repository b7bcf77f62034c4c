"""``IdleFlusher``: write dirty host chunks below while the engine has nothing to do.

Why: under write-back, a chunk reaches the write-back tiers only when the host pool needs
its slot (a spill). Everything still dirty when the process ends is lost, and vLLM's API
server, with its default ``--shutdown-timeout 0``, kills the engine core right after
SIGTERM: the connector's shutdown flush never runs. Writing dirty chunks when the engine
is idle costs no extra bytes in the long run (write-back writes every chunk it evicts
anyway) and no serving time (the engine is idle, and the flush uses the store queue,
behind loads), and it leaves almost nothing dirty when a drained server is stopped.

Threads: ``busy`` is called on vLLM's scheduler thread (each engine step; memory only).
``tick`` runs on the flusher's own thread (or a test's); it only queues store jobs, never
waits on storage. Time comes from the injected ``Clock``; tests call ``tick`` directly.
"""

from __future__ import annotations

import logging
import threading

from kvtier.clock import SYSTEM_CLOCK, Clock
from kvtier.store import TieredStore

log = logging.getLogger("kvtier.store")


class IdleFlusher:
    def __init__(
        self,
        store: TieredStore,
        idle_s: float,
        *,
        batch: int = 8,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if idle_s <= 0:
            raise ValueError(f"idle_s must be > 0, got {idle_s}")
        self.store = store
        self.idle_s = idle_s
        self.batch = batch
        self.clock = clock
        self._last_busy = clock.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.queued = 0

    def busy(self) -> None:
        """The engine did work now (scheduler thread)."""
        self._last_busy = self.clock.monotonic()

    def tick(self) -> int:
        """Queue a batch of dirty chunks if the engine has been idle for ``idle_s`` and the
        store queue is empty; returns how many were queued."""
        if self.clock.monotonic() - self._last_busy < self.idle_s:
            return 0
        if self.store.io.pending()[1]:
            return 0  # earlier writes first: never build a backlog
        n = self.store.write_back_some(self.batch)
        self.queued += n
        return n

    def start(self, interval_s: float = 0.5) -> IdleFlusher:
        def run() -> None:
            while not self._stop.wait(interval_s):
                try:
                    self.tick()
                except Exception:  # a flush is best effort; the next tick tries again
                    log.exception("kvtier: idle flush failed")

        self._thread = threading.Thread(target=run, name="kvtier-idle-flush", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
