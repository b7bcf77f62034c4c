"""The step bookkeeping with the workers: each step's metadata (copy ops out), and the
workers' reports folded back (load acks release holds, saves commit or abort, failed
loads are recomputed by vLLM). Scheduler thread; memory only.
"""

from __future__ import annotations

import logging
from typing import Any

from kvtier.keys import ChunkKey
from kvtier.metrics import record_failed_loads, record_restore
from kvtier.vllm.protocol import KVTierMetadata, KVTierWorkerMetadata
from kvtier.vllm.scheduler.load import Loads
from kvtier.vllm.scheduler.records import STAGED_STEPS
from kvtier.vllm.scheduler.save import Saves

log = logging.getLogger("kvtier.vllm")


class Steps(Loads, Saves):
    """Step metadata out, worker reports in."""

    def build_meta(self, scheduler_output: Any = None) -> KVTierMetadata:
        self._step += 1
        if self._lookups:
            self._release_stale_staging()
        if self.flusher is not None:
            self.flusher.busy()
        if self.step_timer is not None and scheduler_output is not None:
            self.step_timer.built(self._step, scheduler_output, self._loads)
        if self._streams:
            self._advance_streams()
        acked, saves_more = self._stamp_save_streams(self._step)
        meta = KVTierMetadata(self._step, self._loads, self._to_save,
                              async_loads=self.shape.async_loads,
                              async_reqs=self._async_reqs, more=sorted(self._streams),
                              saves_acked=acked, saves_more=saves_more)
        if self._load_holds:
            self._holds_by_step[self._step] = self._load_holds
        self._loads, self._to_save, self._load_holds, self._async_reqs = [], [], [], []
        return meta

    def on_worker_output(self, finished_sending: set[str] | None, worker_meta: Any, *,
                         failed_load_blocks: int = 0, failed_loads: set[str] | None = None,
                         finished_recving: set[str] | None = None) -> None:
        """A step's output, folded over every rank by vLLM: saves finished on every rank,
        our worker metadata, how many blocks failed to load on any rank (vLLM's union,
        counted here once, not per rank), and the requests whose asynchronous loads
        failed (a hybrid model's: vLLM recomputes them)."""
        if failed_load_blocks:
            record_failed_loads(failed_load_blocks)
        self._recving.difference_update(finished_recving or ())
        for rid in failed_loads or ():
            live = rid in self._epoch_of  # not finished or aborted meanwhile
            if live:
                log.warning("kvtier: restore of %s failed; vLLM recomputes it", rid)
            st = self._streams.pop(rid, None)
            if st is not None:
                st.cancel()
            self._unconfirmed.pop(rid, None)
            record_failed_loads(self._async_blocks.pop(rid, 0))
            self._recving.discard(rid)
            if live:  # vLLM asks again: the answer is 0 from now on
                self._load_failed.add(rid)
        for rid in finished_recving or ():
            done = self._unconfirmed.pop(rid, None)
            if done is not None:  # every copy landed: now it counts as restored
                record_restore(done[0])
                self._restored[rid] = done
        if isinstance(worker_meta, KVTierWorkerMetadata):
            if self.step_timer is not None:
                self.step_timer.done(worker_meta.step)
            for step in worker_meta.loaded_steps:
                # every rank reads the step's slots: release them after the last one
                acks = self._load_acks.get(step, 0) + 1
                if acks < self.geom.tp_world:
                    self._load_acks[step] = acks
                    continue
                self._load_acks.pop(step, None)
                for held in self._holds_by_step.pop(step, []):
                    held.release()
            for step in worker_meta.saved_steps:
                self._save_step_acked(step, False)
            for step in worker_meta.failed_save_steps:
                self._save_step_acked(step, True)
            if self._streams:  # slots came back: the next reads start now
                self._advance_streams()
            if self._save_streams:  # and the next streamed saves get theirs
                self._advance_save_streams()
            # a rank's failure comes with its own report; the save is finished (below)
            # only once every rank has reported it, possibly steps later
            self._failed_saves.update(r for r in worker_meta.failed_saves
                                      if r in self._saves or r in self._save_streams)
        for rid in finished_sending or ():
            save = self._saves.pop(rid, None)
            failed = rid in self._failed_saves
            self._failed_saves.discard(rid)
            self._end_save_stream(rid, failed)
            if save is None:
                continue
            lost: list[ChunkKey] = []
            for slot, meta in save.slots:
                if failed:
                    self.store.abort(slot)
                elif not self.store.commit(slot, meta):
                    lost.append(meta.key)  # a backup another save beat to it
            if save.supersedes and not failed:
                self.store.delete(save.supersedes)
            if lost and self.role != "both":
                # this request announced them: offer the published copies to the shared
                # tiers again, in case the winner's write-through was dropped (a CREATE
                # that finds the object costs one existence check)
                self.store.rewrite_through(lost)

    def has_pending_saves(self) -> bool:
        """Saves not finished yet (the engine is not idle; a reset waits for them)."""
        return bool(self._saves or self._save_streams)

    def has_frees_due(self) -> bool:
        """Blocks of finished requests that come back within a step or two: saves whose
        copies are out (``_saves``), and save streams with every piece given a slot.
        vLLM stops preempting while this is True (it expects the frees to make room), so
        a save stream still waiting for host slots (seconds, at worst its wait bound)
        does not count: running requests would stall behind it."""
        return bool(self._saves) or any(not st.pending for st in self._save_streams.values())

    def _release_stale_staging(self) -> None:
        """Release staged lookups vLLM did not admit within ``STAGED_STEPS`` steps (their
        request waits for GPU blocks); the request stages again when asked next."""
        for rid, lk in list(self._lookups.items()):
            if lk.staged_step is not None and self._step - lk.staged_step > STAGED_STEPS:
                log.debug("kvtier: %s not admitted in %d steps; releasing its staged KV",
                          rid, STAGED_STEPS)
                self._forget(rid)
