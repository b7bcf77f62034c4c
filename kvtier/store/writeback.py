"""``WriteBack``: writing host slots to the lower tiers, and keeping dirty chunks from
filling the host pool.

* ``_write_slot`` writes one held host slot to some tiers (the write every other write
  is made of: write-through, re-offer, spill, write-back, flush) and queues a collection
  of each tier it stored into (``_collect_later``: capacity, as a job of its own).
* ``_queue_write_back`` fans one dirty chunk out to the write-back tiers, one job per
  tier's IO pool. The chunk turns clean (evictable) once ONE tier holds it; the other
  tiers give that copy up (counted). A write that every write-back tier failed leaves the
  chunk dirty (nothing stored is lost) and restarts its age.
* ``_spill_if_needed`` keeps the pool ahead of need: while free-or-clean host slots,
  counting those whose spill is in flight, are below the low-water mark, the coldest
  dirty chunks are queued to the write-back tiers (``_queue_write_back``); each turns
  clean once written, as above.
* ``_clean_one`` is the synchronous spill of one chunk, on an IO thread, for a promotion
  that found every host slot held or dirty.

Threads and locks: ``StoreState``. The spill check runs on whatever thread reserved or
committed a slot (memory only: it queues jobs); the writes run on IO threads.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any

from kvtier.health import TierUnavailable
from kvtier.iopool import IOPool, IOPoolClosed
from kvtier.objformat import ChunkMeta
from kvtier.store.state import StoreState
from kvtier.store.types import LoadProgress
from kvtier.tiers.base import PutStatus, Tier, WriteMode


@dataclass
class _FanOut:
    """One write-back fan-out's progress (under ``StoreState._lock``): jobs not yet done,
    whether one tier holds the chunk, whether the fan-out still holds its slot."""

    left: int
    ok: bool = False
    holding: bool = True


class WriteBack(StoreState):
    def _write_slot(
        self, slot: int, meta: ChunkMeta, tiers: Sequence[Tier], kind: str, *,
        every: bool = True,
    ) -> bool:
        """Write one held host slot to ``tiers``; True if every tier (with ``every``,
        else at least one) now holds it. A tier
        whose breaker is open is skipped and the write counted as dropped; a tier whose
        ``put`` raises is counted (``kvtier_store_errors_total{tier,kind}``, logged once
        per tier and kind) and the other tiers are still written."""
        view = self.host.view(slot, meta.payload_len).data
        ok = True
        some = False
        for tier in tiers:
            try:
                with self._call(tier, read=False, nbytes=meta.object_len):
                    status = tier.put(meta, view, WriteMode.CREATE)
            except TierUnavailable:
                self._count_drop("tier_down")
                ok = False
                continue
            except Exception:
                self._job_failed(tier.name, kind)
                ok = False
                continue
            stored = status in (PutStatus.STORED, PutStatus.EXISTS)
            ok &= stored
            some |= stored
            if status in (PutStatus.STORED, PutStatus.NO_SPACE):  # full: collect now
                self._collect_later(tier)
        return ok if every else some

    def _collect_later(self, tier: Tier) -> None:
        """Queue one collection of ``tier`` (capacity) as its own job, outside any timed
        call, unless one is queued already: a big collection is not a slow write."""
        with self._lock:
            if id(tier) in self._collecting:
                return
            self._collecting.add(id(tier))

        def job() -> int:
            with self._lock:
                self._collecting.discard(id(tier))
            return tier.collect()

        try:
            fut = self._submit(job, "collect", self._pool_of(tier), count_drop=False)
        except IOPoolClosed:  # a write that ran on while the store closed: no collection
            fut = None
        if fut is None:
            with self._lock:
                self._collecting.discard(id(tier))

    def _queue_write_back(
        self, slot: int, meta: ChunkMeta, tiers: Sequence[Tier], *, held: bool, kind: str,
    ) -> Future[Any] | None:
        """Queue a write of the dirty chunk in ``slot`` to the write-back ``tiers``, one
        job per tier's IO pool; the result is True once ONE tier holds the chunk.
        ``None`` if the chunk was evicted first or no job could be queued (counted; the
        chunk is as it was: a full queue is not a failed write).

        Each tier's trouble is its own (issue 32): the chunk is marked clean as soon as
        one tier has stored it, so a write-back tier that is down, hung or refusing
        writes never keeps host slots dirty while another one works. The tiers that
        did not get it give up that copy (counted as a drop, ``tier_down`` or
        ``gave_up_copy``): the chunk is read from the tier that holds it, and a later
        save of the same key writes it again. Tiers whose breaker refuses calls now are
        not queued at all (their pool may be stuck behind a hang).

        Holds: the fan-out keeps one hold on ``slot`` (the caller's, with ``held``), so
        no other spill takes the dirty chunk, until it is clean or every tier failed;
        each job holds the chunk itself only while it runs, so a job queued behind a
        hung tier holds no host slot once the chunk is clean elsewhere (it then finds
        the chunk evicted and gives its copy up). The chunk is marked clean, or its
        write failure recorded, by the job while it still holds the slot. Every tier
        failing leaves the chunk dirty (nothing stored is lost) and restarts its age."""
        if not held and self.host.index.hold(meta.key) is None:
            return None  # evicted before we got to it
        groups: dict[int, tuple[IOPool, list[Tier]]] = {}
        for tier in tiers:
            b = self._breaker_of.get(id(tier))
            if b is not None and not (b.up or b.available()):
                self._count_drop("tier_down")
                continue
            pool = self._pool_of(tier)
            groups.setdefault(id(pool), (pool, []))[1].append(tier)
        whole: Future[Any] = Future()
        whole.set_running_or_notify_cancel()
        fan = _FanOut(left=len(groups))

        def settle(ok: bool, at: int | None) -> None:
            """One job is done (``at``: the slot it holds, None if it holds none)."""
            with self._lock:
                fan.left -= 1
                first_ok = ok and not fan.ok
                fan.ok = fan.ok or ok
                last_failed = not fan.left and not fan.ok
                let_go = (first_ok or last_failed) and fan.holding
                if let_go:
                    fan.holding = False
            where = slot if at is None else at
            if first_ok:
                self.host.index.mark_clean(where, meta.key)  # held: never reused here
            elif last_failed:
                self.host.index.write_failed(where, meta.key)
            if let_go:
                self.host.release(slot)
            if first_ok or last_failed:
                whole.set_result(first_ok)

        def job(group: list[Tier]) -> bool:
            got = self.host.index.hold(meta.key)
            if got is None:  # clean (another tier has it) and evicted since: give up
                self._count_drop("gave_up_copy")
                settle(False, None)
                return False
            at = got[0]
            ok = False
            try:
                ok = self._write_slot(at, got[1], group, kind, every=False)
            finally:
                try:
                    settle(ok, at)
                finally:
                    self.host.release(at)
            return ok

        if not groups:
            self.host.release(slot)  # every tier is down: it stays dirty, as it was
            return None
        queued = 0
        for pool, group in groups.values():
            fut = self._submit(partial(job, group), kind, pool)
            if fut is None:
                settle(False, None)  # the hold is still ours if no job stored it yet
            else:
                queued += 1
        if not queued:
            return None
        self._inflight.add(whole)
        whole.add_done_callback(self._inflight.discard)
        return whole

    def _spill_if_needed(self) -> None:
        """Queue the coldest dirty chunks for spilling while free-or-clean slots, plus
        those being spilled, are below the low-water mark (at most ``spill_batch`` at a
        time). Memory only."""
        if not self._back:
            return
        with self._lock:
            short = self._reserve_slots - self.host.index.clean_or_free() - self._spilling
        if short <= 0:
            return
        if not self.can_write_back():
            return  # every write-back tier is down: the chunks stay dirty (not lost)
        for slot, meta in self.host.index.take_dirty(min(short, self._spill_batch)):
            with self._lock:
                self._spilling += 1
            fut = self._queue_write_back(slot, meta, self._back, held=True, kind="spill")
            if fut is None:
                with self._lock:
                    self._spilling -= 1
            else:
                fut.add_done_callback(self._spilled)

    def _spilled(self, _: Future[Any]) -> None:
        """A spill ended (written or not): it no longer counts towards the mark."""
        with self._lock:
            self._spilling -= 1

    def _clean_one(self, progress: LoadProgress | None, pool: IOPool) -> bool:
        """IO threads only: write the coldest dirty, unheld host chunk to a write-back
        tier now and mark it clean (evictable), for a promotion on ``pool`` that found
        every slot held or dirty; the time is the load's ``slot`` stage. False if there
        is no such chunk, no write-back tier that ``pool`` serves may be written, or the
        write failed (the chunk stays dirty)."""
        # one write-back tier of the calling pool, whose breaker is closed and which has
        # no call overdue: a chunk is clean once ONE tier holds it (issue 32), and a
        # load's thread never writes to a tier that is down or hanging, nor to another
        # pool's tier (one that has just hung would hang this pool with it: review N12)
        up = [t for t in self._back if self._pool_of(t) is pool
              and ((b := self._breaker_of.get(id(t))) is None
                   or (b.up and not b.overdue(b.stuck_s)))]
        if not up:
            return False
        t0 = time.perf_counter()
        picked = self.host.index.take_dirty(1)
        if not picked:
            return False
        slot, meta = picked[0]
        try:
            ok = self._write_slot(slot, meta, up[:1], "spill")
            if ok:
                self.host.index.mark_clean(slot, meta.key)
            else:
                self.host.index.write_failed(slot, meta.key)
        finally:
            self.host.release(slot)
            if progress is not None:
                progress.waited("slot", time.perf_counter() - t0)
        return ok
