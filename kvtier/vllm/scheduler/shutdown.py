"""Reset (``reset_cache``) and engine shutdown (the flush of dirty host chunks within
``shutdown_flush_seconds``). Scheduler thread (``close``: the engine's shutdown, which
waits on the store within its budget).
"""

from __future__ import annotations

import logging
import time

from kvtier.vllm.scheduler.state import SchedulerState

log = logging.getLogger("kvtier.vllm")


class Shutdown(SchedulerState):
    """Cache reset and engine shutdown."""

    def reset(self) -> bool:
        """``reset_cache`` (vLLM's ``reset_prefix_cache(reset_connector=True)``).

        ``reset_cache: weights`` (default; RL trainers reset after a weight sync): from
        now on this engine never serves KV it stored before. The weights epoch is bumped
        (``RequestIdentities.bump_epoch``: every namespace digest made from now on
        differs), cached keys and staged lookups of waiting requests are dropped, and the
        host tier is emptied, dirty chunks included: they may have been computed with the
        old weights, so they are dropped, never written below. Lower tiers keep what they
        hold (other nodes and restarts share them; this engine never asks for the old
        epoch's keys again, and after a restart epoch 0 means the weights on disk again).
        Memory only: returns at once.

        ``reset_cache: host``: only the host tier is emptied; what the lower tiers hold is
        still served. Dirty chunks are queued to the write-back tiers, never waited for:
        the reset answers False (vLLM's "not done, ask again", as while a save is in
        flight) until they are written and dropped. Memory only: returns at once.
        """
        for rid in list(self._lookups):
            self._forget(rid)
        self._probes.clear()
        self._tail_probes.clear()
        self._waiting.clear()
        if self.cfg.reset_cache == "host":
            n, empty = self.store.empty_host()
            log.info("kvtier: reset dropped %d host chunks%s", n,
                     "" if empty else "; dirty or busy chunks remain (written, then dropped)")
            return empty
        self.identities.bump_epoch()  # cached keys are rebuilt (_Keys.epoch)
        for st in self._save_streams.values():
            st.pending = []  # computed with the old weights: copy no more of it
        for rid, stream in list(self._streams.items()):
            # reading KV of the old weights: it must not be delivered after the reset
            log.info("kvtier: reset: ending the streamed restore of %s (vLLM recomputes it)",
                     rid)
            del self._streams[rid]
            stream.cancel()
            self._tell_ended(rid)
        if self.role != "both":
            log.warning("kvtier: %s node: after this weights reset it shares KV with no "
                        "node that has not reset with it (the epoch is this engine's "
                        "own); P/D hand-offs recompute until both restart",
                        self.role)
        n = self.store.drop_host()
        log.info("kvtier: reset: new weights epoch, dropped %d host chunks", n)
        return True

    def stop_flush_pending(self) -> bool:
        """A stop signal started a flush that is still running (within its budget): vLLM's
        engine loop keeps stepping (``has_pending_push_work``), so its own signal handler
        stays installed and a second SIGTERM cannot kill the flush. Memory only."""
        return self.flusher is not None and self.flusher.stop_flush_pending()

    def close(self) -> None:
        """Engine shutdown: flush dirty host chunks below, most recent first, and finish
        queued writes, all within ``shutdown_flush_seconds`` (including a flush a stop
        signal already started), so a restarted engine restores them."""
        budget = self.cfg.shutdown_flush_seconds
        if self.flusher is not None:  # one budget, counted from the stop signal's flush
            budget = self.flusher.stop_deadline_left(budget)
        t0 = time.monotonic()
        for rid in list(self._lookups):
            self._forget(rid)
        for st in self._streams.values():
            st.cancel()
        if self.flusher is not None:
            self.flusher.close(timeout=budget)
        self.store.shutdown(max(0.0, budget - (time.monotonic() - t0)))
        self.identities.close()
