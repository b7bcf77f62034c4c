"""``Writes``: filling host slots, and the write-through fan-out.

``put``, or ``reserve(key)`` then ``commit(slot, meta)`` / ``abort(slot)``, is the one
way into the host tier: a slot is reserved for a key and gets its meta when committed,
and the caller never waits on storage. A commit queues the chunk to each write-through
tier at once (``_queue_write``, one job per tier's IO pool); with write-back tiers the
chunk is *dirty* until one of them holds it (``WriteBack``), and every reservation and
commit checks the low-water mark (``_spill_if_needed``).

Threads and locks: ``StoreState``. Everything here is memory only on the calling thread
(vLLM's scheduler thread): the writes below run as jobs on IO threads.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any

import numpy as np

from kvtier.iopool import IOPool
from kvtier.keys import ChunkKey
from kvtier.objformat import ChunkMeta
from kvtier.store.writeback import WriteBack
from kvtier.tiers.base import Tier

#: Re-offered keys remembered (``rewrite_through(min_age_s=...)``).
OFFERED_MAX = 65536
#: A write-through pool whose held jobs have waited this long (plus one chunk at 20 MiB/s,
#: the breakers' default slowest healthy rate) to start is not taking them (a hung tier
#: behind its threads, not yet overdue): new jobs past ``_through_cap`` then take their
#: hold when they start (``Writes._may_hold``). Healthy small jobs start in milliseconds.
THROUGH_PATIENCE_S = 0.2
THROUGH_MIN_BYTES_PER_S = 20 * 2**20


class Writes(WriteBack):
    def put(self, meta: ChunkMeta, payload: Any) -> bool:
        """Copy one chunk into the host tier. False if it was present or had to be dropped."""
        self.host.check_fits(meta)
        r = self.host.reserve(meta.key)
        if r is None:
            if not self.host.index.contains(meta.key):
                self._count_drop("host_full")
            return False
        try:
            src = np.frombuffer(payload, dtype=np.uint8, count=meta.payload_len)
            np.copyto(self.host.view(r.slot, meta.payload_len), src)
        except BaseException:
            self.host.abort(r.slot)
            raise
        self.commit(r.slot, meta)
        return True

    def reserve(self, key: ChunkKey, *, backup: bool = False) -> int | None:
        """A host slot to fill with ``key``'s chunk (then ``commit`` with its meta, or
        ``abort``); None if the chunk is already there (or being written, unless
        ``backup``) or every slot is held or dirty: the caller copies nothing. A backup is
        a second slot for a chunk someone else is writing, for a caller that must not
        depend on that other write: the first commit is published, the other is freed.
        Memory only."""
        r = self.host.reserve(key, backup=backup)
        if self._back:
            self._spill_if_needed()  # a save took a slot (or found none): keep ahead
        return None if r is None else r.slot

    def holds(self, key: ChunkKey) -> bool:
        """The host tier holds ``key`` or is writing it (another request's save in
        flight). Memory only."""
        return self.host.index.contains(key) or self.host.index.pending(key)

    def saving(self, key: ChunkKey) -> int:
        """How many saves are writing ``key`` into a host slot, not published yet (0: none;
        2: a save and its backup, the most there are). Memory only."""
        return self.host.index.writers(key)

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        """Drop ``keys`` from the host tier where present and unheld, dirty or not, never
        writing them below: chunks a longer save supersedes (a partial tail whose bytes
        a whole chunk or a longer tail repeats). Returns how many were dropped. Memory
        only."""
        return self.host.delete(keys)

    def abort(self, slot: int) -> None:
        """Give back a reserved slot whose copy failed; nothing is published."""
        self.host.abort(slot)

    def commit(self, slot: int, meta: ChunkMeta) -> bool:
        """Publish a slot filled after ``reserve(meta.key)``; queue its lower-tier writes.
        False if another reservation of the key was published first (a backup that lost:
        its slot is freed, nothing is queued)."""
        if not self.host.commit(slot, meta, dirty=bool(self._back)):
            return False  # the caller may rewrite_through([meta.key]) if it announced it
        self.host.metrics.wrote(meta.payload_len)
        if self._through:
            self._mark_offered([meta.key])  # a write counts as an offer (rewrite_through)
        for tier in self._through:
            self._queue_write(slot, meta, [tier], kind="write_through")
        if self._back:
            self._spill_if_needed()
        return True

    def rewrite_through(self, keys: Sequence[ChunkKey], min_age_s: float = 0.0) -> int:
        """Offer host-resident ``keys`` to every write-through tier again, as one queued job;
        returns how many were host-resident when queued (0 if the job was dropped).

        For a node that announces chunks to another node (P/D): the host tier can outlive
        a shared tier's copy (another node's collector removed it past its lease, which
        this node's index cannot see). Each tier's CREATE put asks the tier itself first,
        so what is still there costs one existence check and no write. One job, not one
        per chunk, so a long prompt cannot fill the store queue and crowd out new chunks.
        """
        now = self.host.clock.monotonic()
        with self._lock:
            fresh = {k for k in keys
                     if k in self._offered and now - self._offered[k] < min_age_s}
        held = [k for k in keys if self.host.index.contains(k)]
        todo = [k for k in held if k not in fresh]
        if not self._through or not held:
            return 0
        if not todo:
            return len(held)  # each offered within min_age_s: nothing to ask again
        self._mark_offered(todo)

        def job(tier: Tier) -> None:
            for key in todo:
                got = self.host.index.hold(key)
                if got is None:
                    continue  # evicted since
                slot, meta = got
                try:
                    self._write_slot(slot, meta, [tier], "reoffer")
                finally:
                    self.host.release(slot)

        queued = [self._submit(partial(job, t), "reoffer", self._pool_of(t))
                  for t in self._through]
        return len(held) if all(f is not None for f in queued) else 0

    def _may_hold(self, pool: IOPool) -> bool:
        """May a new write-through job of ``pool`` hold its slot from the commit? Yes
        while its held jobs are under ``_through_cap``, or while none of its held jobs has
        waited to start for ``THROUGH_PATIENCE_S``: a pool that is taking its jobs is not
        hung, and its jobs must keep their chunks (a save streamed through a small pool
        reuses each slot as soon as its copy is written)."""
        now = self.host.clock.monotonic()
        with self._lock:
            if self._through_holds.get(id(pool), 0) < self._through_cap:
                return True
            waiting = self._through_waiting.get(id(pool))
            patience = THROUGH_PATIENCE_S + self.host.slot_bytes / THROUGH_MIN_BYTES_PER_S
            return not waiting or now - min(waiting.values()) < patience

    def _through_queued(self, pool: IOPool) -> int:
        """Count a held job queued on ``pool``; its token for ``_through_started``."""
        now = self.host.clock.monotonic()
        with self._lock:
            self._through_holds[id(pool)] = self._through_holds.get(id(pool), 0) + 1
            self._through_token += 1
            self._through_waiting.setdefault(id(pool), {})[self._through_token] = now
            return self._through_token

    def _through_started(self, pool: IOPool, token: int) -> None:
        with self._lock:
            waiting = self._through_waiting.get(id(pool))
            if waiting is not None:
                waiting.pop(token, None)

    def _through_done(self, pool: IOPool, token: int) -> None:
        with self._lock:
            self._through_holds[id(pool)] -= 1
            waiting = self._through_waiting.get(id(pool))
            if waiting is not None:
                waiting.pop(token, None)

    def _write_through_job(self, slot: int, meta: ChunkMeta, tiers: list[Tier], kind: str,
                           pool: IOPool, held: int | None) -> bool:
        """One pool's part of a write-through (an IO thread): write the chunk to
        ``tiers``, holding its slot; ``held``: the hold was taken when the job was
        queued (the token ``_queue_write`` counted it under), else (None) it is taken
        now, and a chunk evicted meanwhile is a copy given up (counted)."""
        if held is not None:
            self._through_started(pool, held)
        else:
            got = self.host.index.hold(meta.key)
            if got is None:
                self._count_drop("gave_up_copy")
                return False
            slot, meta = got
        try:
            return self._write_slot(slot, meta, tiers, kind)
        finally:
            if held is not None:
                self._through_done(pool, held)
            self.host.release(slot)

    def _mark_offered(self, keys: Sequence[ChunkKey]) -> None:
        now = self.host.clock.monotonic()
        with self._lock:
            for k in keys:
                self._offered[k] = now
                self._offered.move_to_end(k)
            while len(self._offered) > OFFERED_MAX:
                self._offered.popitem(last=False)

    def _queue_write(
        self, slot: int, meta: ChunkMeta, tiers: Sequence[Tier], *, kind: str,
    ) -> Future[Any] | None:
        """Queue a write of the committed chunk in host ``slot`` to ``tiers``, one job per
        tier's IO pool; the result is True if every tier holds the chunk (a
        write-through: compare ``_queue_write_back``, where one tier holding it is
        enough).

        A tier whose breaker refuses calls is not queued (a drop, ``tier_down``). A job
        holds the slot from now until it is done, so the chunk is written before it can
        be evicted, only while its pool's tiers answer (no call overdue by the breaker's
        ``stuck_s``) and its pool is taking its jobs (``_may_hold``: fewer held jobs
        than ``_through_cap``, half the host pool, or none waiting to start for
        ``THROUGH_PATIENCE_S``); otherwise it takes its hold when it starts
        (``_write_through_job``). So a hung write-through tier pins about that share of
        the host pool, instead of one slot per queued job (up to ``max_queued_stores``)
        until it recovers (review N3), and a healthy one keeps every chunk it writes.

        ``None`` if the chunk was evicted first or no job could be queued (counted; the
        chunk is as it was: a full queue is not a failed write)."""
        groups: dict[int, tuple[IOPool, list[Tier]]] = {}
        stalled: set[int] = set()  # pools with a tier not answering now
        skipped = False
        for tier in tiers:
            b = self._breaker_of.get(id(tier))
            if b is not None and not (b.up or b.available()):
                self._count_drop("tier_down")  # its pool may be stuck behind a hang
                skipped = True
                continue
            pool = self._pool_of(tier)
            groups.setdefault(id(pool), (pool, []))[1].append(tier)
            if b is not None and b.overdue(b.stuck_s):
                stalled.add(id(pool))
        if not groups or self.host.index.hold(meta.key) is None:
            return None  # every tier refuses writes, or evicted before we got to it
        parts: list[Future[Any]] = []
        try:
            for pool, group in groups.values():
                # A job holds the slot from now (the chunk stays until it is written)
                # while its tier answers and its pool's held jobs are within their share
                # of the host pool; else it takes its hold when it starts and gives the
                # copy up if the chunk was evicted meanwhile (a hung tier pins no slot).
                held: int | None = None
                if id(pool) not in stalled and self._may_hold(pool):
                    self.host.index.hold(meta.key)  # our own hold keeps the key in ``slot``
                    held = self._through_queued(pool)
                fut = self._submit(partial(self._write_through_job, slot, meta, group, kind,
                                           pool, held), kind, pool)
                if fut is None:
                    if held is not None:
                        self._through_done(pool, held)
                        self.host.release(slot)
                else:
                    parts.append(fut)
        finally:
            self.host.release(slot)  # our own hold
        if not parts:
            return None
        whole: Future[Any] = Future()
        whole.set_running_or_notify_cancel()
        missing = skipped or len(parts) < len(groups)
        left = len(parts)

        def part_done(_: Future[Any]) -> None:
            nonlocal left
            with self._lock:
                left -= 1
                if left:
                    return
            ok = not missing and all(
                not f.cancelled() and f.exception() is None and bool(f.result())
                for f in parts)
            whole.set_result(ok)

        self._inflight.add(whole)
        whole.add_done_callback(self._inflight.discard)
        for f in parts:
            f.add_done_callback(part_done)
        return whole
