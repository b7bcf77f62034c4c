"""``TieredStore``: an ordered list of tiers, host first, that owns cascade and promotion.

Data flows:

* ``put`` / ``reserve(key)``+``commit(slot, meta)`` write into the host tier only (the one
  entry point for filling host slots: a slot is reserved for a key and gets its meta when
  committed); the caller never waits on storage. Each write-through tier gets the chunk
  queued at once. With write-back tiers the chunk is *dirty* until spilled. The pool
  spills ahead of need: whenever free-or-clean host slots, counting those whose spill is
  in flight, fall below the *low-water mark* (``clean_reserve`` of the pool, at least
  one slot), the coldest dirty chunks are queued for spilling, then marked clean and so
  evictable. Checked after every commit and every reservation (a save's or a
  promotion's), and when a promotion finds no slot: a save or a restore finds a clean
  slot instead of failing for want of one, as long as the tier keeps up.
* ``lookup`` answers "how long is the stored prefix, and where is each chunk".
* ``load(found)`` takes that answer, promotes its lower-tier entries into host slots (on
  the IO pool, ahead of stores) from the tier the lookup named, and hands back the chunks
  *held* (``Held``), so they cannot be evicted before the caller copies them.

Invariants:

* A dirty chunk is never evicted. It turns clean once ONE write-back tier holds it (the
  others give that copy up, counted: one tier's trouble never keeps host slots dirty);
  a write that every write-back tier failed leaves it dirty (nothing stored is lost) and
  restarts its age. The store is a cache: losing a chunk costs a recompute, serving a
  wrong one is never allowed.
* A store queue that is full drops the write and counts it (``kvtier_drops_total``).
* Chunks promoted from a lower tier are clean: they are already stored below.
* ``load(keys, expect)`` serves a chunk only if it is what the reader expects (``ChunkSpec``:
  namespace, tokens, dtype, shape, payload length), host hits included: the worker copies
  whole slots, so a short or foreign chunk would hand it stale bytes. A mismatch is a
  counted corruption and a miss that ends the prefix; the lower tiers also remove the object
  (only if it is still the one read).
* ``load`` never trusts a stale lookup: a host entry evicted since, or an object gone from
  the tier named, is a counted miss there, then read from the next lower tier whose index
  knows it (memory only) if any, else the end of the prefix (recompute). Never a wrong
  chunk, and a tier's own answer is asked only where the lookup or that fallback points.
* ``load`` leaks nothing: a promotion slot is committed or aborted, never left WRITING, and
  a future that fails (only a bug can make it) holds no slots; one that succeeds holds
  exactly the slots in its ``Held``, to be released once.

Threads: ``lookup_indexed``, ``reserve``/``holds``/``commit``/``abort``, ``put``, ``load``
and ``can_probe``/``probe`` do no I/O on the calling thread (vLLM's scheduler thread calls
them); ``lookup`` and ``get_into`` may, and are for IO threads and tools. A ``Held`` may
be released from any thread.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from functools import partial
from typing import Any

import numpy as np

from kvtier.clock import SYSTEM_CLOCK, Clock
from kvtier.config import HealthConfig
from kvtier.health import Breaker, TierUnavailable, breakers_for
from kvtier.iopool import IOPool, IOPoolClosed
from kvtier.keys import ChunkKey
from kvtier.metrics import record_drop, record_store_error
from kvtier.objformat import ChunkMeta, ChunkSpec
from kvtier.tiers.base import PutStatus, SharedTier, Tier, WriteMode
from kvtier.tiers.host import HostTier

log = logging.getLogger("kvtier.store")

HOST = 0  # tier index of the host tier in every Lookup
#: A read that finds another thread filling the host slot of its key re-checks its own
#: cancellation this often while it waits for that fill (``TieredStore._promote_one``).
SETTLE_SLICE_S = 0.05
#: ... and, for a read nobody can cancel (tools), gives up after this long.
SETTLE_MAX_S = 30.0
#: A promotion that finds every host slot held or dirty writes at most this many dirty
#: chunks below itself to free one (``TieredStore._clean_one``) before it gives up.
CLEAN_MAX = 4

#: Probes waiting for a probe thread before ``probe`` refuses more.
PROBE_QUEUE = 64
#: A key no tier had is not asked again for this long (a burst of one new prefix).
PROBE_MISS_TTL_S = 0.25
PROBE_MISS_MAX = 4096
#: Re-offered keys remembered (``rewrite_through(min_age_s=...)``).
OFFERED_MAX = 65536

#: A held host slot and the tier its chunk was read from: ``((slot, meta), tier index)``.
_Hit = tuple[tuple[int, ChunkMeta], int]
#: A chunk to load: its key, the tier the lookup found it in, and what it must be.
_Entry = tuple[ChunkKey, int, ChunkSpec | None]


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
    load (``waited``); read it once the load's future is done."""

    def __init__(self, clock: Clock = SYSTEM_CLOCK) -> None:
        self.clock = clock
        self.last = clock.monotonic()
        self.cancelled = False
        self.stages: dict[str, float] = {}

    def touch(self) -> None:
        self.last = self.clock.monotonic()

    def waited(self, stage: str, seconds: float) -> None:
        """Add ``seconds`` to ``stage`` (the IO thread running the load)."""
        self.stages[stage] = self.stages.get(stage, 0.0) + seconds

    def idle_for(self) -> float:
        return self.clock.monotonic() - self.last

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class Held:
    """Host slots held for reading (never evicted meanwhile), in key order. Release
    exactly once, from any thread."""

    store: TieredStore
    slots: list[tuple[int, ChunkMeta]] = field(default_factory=list)
    from_tier: list[int] = field(default_factory=list)

    def add(self, hit: _Hit) -> None:
        self.slots.append(hit[0])
        self.from_tier.append(hit[1])

    def view(self, i: int) -> np.ndarray:
        slot, meta = self.slots[i]
        return self.store.host.view(slot, meta.payload_len)

    def release(self) -> None:
        for slot, _ in self.slots:
            self.store.host.release(slot)
        self.slots = []

    def __len__(self) -> int:
        return len(self.slots)


class TieredStore:
    def __init__(
        self,
        host: HostTier,
        lower: Sequence[LowerTier],
        io: IOPool,
        *,
        spill_batch: int = 8,
        clean_reserve: float = 0.5,
        breakers: Sequence[Breaker] | None = None,
        probe_threads: int = 2,
        tier_io: Sequence[IOPool] | None = None,
    ) -> None:
        """``io`` runs every lower tier's reads and writes, unless ``tier_io`` gives each
        lower tier (in ``lower`` order) a pool of its own: then a hung tier holds only its
        own threads and queue, and the other tiers' loads and writes never wait behind it
        (``build_store`` does this). ``io`` is then the first tier's pool."""
        self.host = host
        self.lower = list(lower)
        #: Probes ("is it there?") run on threads of their own: queued behind writes
        #: stuck in a hung tier, a probe would answer only at its request's deadline.
        #: Bounded: when ``PROBE_QUEUE`` probes wait, ``probe`` answers None at once and
        #: the caller answers from the indexes (a burst never makes everyone wait).
        self.probe_io = IOPool(probe_threads, PROBE_QUEUE, name="probe")
        self._probe_misses: OrderedDict[ChunkKey, float] = OrderedDict()  # key -> when
        self._offered: OrderedDict[ChunkKey, float] = OrderedDict()  # re-offered -> when
        #: One circuit breaker per lower tier (``kvtier/health.py``), in ``lower`` order.
        self.breakers = list(breakers) if breakers is not None else breakers_for(
            [lt.tier.name for lt in self.lower], HealthConfig(), io.num_threads)
        if len(self.breakers) != len(self.lower):
            raise ValueError("one breaker per lower tier")
        self._breaker_of = {id(lt.tier): b for lt, b in zip(self.lower, self.breakers,
                                                             strict=True)}
        self.io = io
        pools = list(tier_io) if tier_io is not None else [io] * len(self.lower)
        if len(pools) != len(self.lower):
            raise ValueError("one IO pool per lower tier")
        self._pools = pools
        self._io_of = {id(lt.tier): pool for lt, pool in zip(self.lower, pools, strict=True)}
        self._collecting: set[int] = set()  # tiers with a collection job queued
        for lt in self.lower:
            if hasattr(lt.tier, "collect_on_put"):
                setattr(lt.tier, "collect_on_put", False)  # noqa: B010 - _collect_later
        self._parts_lock = threading.Lock()
        self._spill_batch = spill_batch
        #: the low-water mark of free-or-clean host slots (counting spills in flight)
        self._reserve_slots = max(1, math.ceil(host.pool.num_slots * clean_reserve))
        self._spilling = 0  # dirty chunks whose spill is queued or running
        self._back = [lt.tier for lt in self.lower if lt.write is WritePolicy.BACK]
        self._through = [lt.tier for lt in self.lower if lt.write is WritePolicy.THROUGH]
        self._inflight: set[Future[Any]] = set()
        self.drops = 0
        self.store_errors = 0  # store jobs that raised (counted per tier and kind too)
        self._logged_errors: set[tuple[str, str]] = set()
        #: Called on an IO thread after each verified lower-tier read into a host slot:
        #: ``(tier name, bytes, seconds)`` (the restore cost model's observations).
        self.on_read: Callable[[str, int, float], None] | None = None

    @property
    def tiers(self) -> list[Tier]:
        return [self.host, *(lt.tier for lt in self.lower)]

    def _pool_of(self, tier: Tier) -> IOPool:
        return self._io_of.get(id(tier), self.io)

    def _distinct_pools(self) -> list[IOPool]:
        return list({id(p): p for p in (self.io, *self._pools)}.values())

    def free_store_slots(self, write: WritePolicy | None = None) -> int:
        """How many more store jobs the fullest pool of the lower tiers written
        ``write`` (all if None) takes now before it drops. Memory only."""
        tiers = [lt.tier for lt in self.lower if write is None or lt.write is write]
        pools = {id(p): p for p in (self._pool_of(t) for t in tiers)}
        return min((p.free_store_slots() for p in pools.values()),
                   default=self.io.free_store_slots())

    def queued_stores(self) -> int:
        """Store jobs queued (not started) over every pool. Memory only."""
        return sum(p.pending()[1] for p in self._distinct_pools())

    # -- lookup ------------------------------------------------------------------------
    def lookup_indexed(self, keys: Sequence[ChunkKey]) -> Lookup:
        """The stored prefix as this process's indexes know it. Memory only: vLLM's
        scheduler thread calls it. Tiers whose breaker is open are skipped."""
        where: list[int] = []
        usable = [(i, lt.tier) for i, (lt, b) in
                  enumerate(zip(self.lower, self.breakers, strict=True), start=1) if b.up]
        for key in keys:
            if self.host.indexed(key):
                where.append(HOST)
                continue
            i = next((i for i, tier in usable if tier.indexed(key)), None)
            if i is None:
                break
            where.append(i)
        return Lookup(tuple(keys[: len(where)]), tuple(where))

    def shared_up(self, *, every: bool) -> bool:
        """Are the write-through tiers' breakers up (``every``: all of them; else any,
        or cooled down enough for a trial)? Memory only. False without such a tier."""
        states = [b.up if every else (b.up or b.available())
                  for lt, b in zip(self.lower, self.breakers, strict=True)
                  if lt.write is WritePolicy.THROUGH]
        return bool(states) and (all(states) if every else any(states))

    def can_write_back(self) -> bool:
        """Would a write to some write-back tier be tried now (its breaker up, or cooled
        down enough for a trial)? Memory only."""
        return any(b.up or b.available() for lt, b in zip(self.lower, self.breakers,
                                                           strict=True)
                   if lt.write is WritePolicy.BACK)

    def can_probe(self) -> bool:
        """Memory only: would ``probe`` ask any lower tier now? (No tier, every tier
        down, or every tier at its read bound: asking would only queue behind a hang.)"""
        return any(b.available() for b in self.breakers)

    def indexes_filling(self) -> bool:
        """Memory only: some lower tier's start scan is still running, so its index does
        not know everything it holds yet (the first seconds after a restart)."""
        return any(not getattr(lt.tier, "index_ready", True) for lt in self.lower)

    def probe(
        self, keys: Sequence[ChunkKey], *, progress: LoadProgress | None = None,
        fresh: bool = False, alternatives: bool = False,
    ) -> Future[int] | None:
        """Ask the lower tiers themselves (on a probe thread) how many of
        ``keys`` lead a stored prefix: objects other nodes wrote, which this process's
        index does not know yet. The answer refreshes the indexes, so the next
        ``lookup_indexed`` sees them. A tier that is down, or has as many reads in flight
        as its breaker allows, is not asked. The future never raises.

        ``None`` (nothing asked) when ``PROBE_QUEUE`` probes are waiting already. A key
        that no tier had within ``PROBE_MISS_TTL_S`` ends the answer without asking
        again (unless ``fresh``: a P/D decode waiting for a key to appear). Once
        ``progress`` is cancelled (the caller's deadline) the probe asks nothing more.
        With ``alternatives`` the keys are not a chain but candidates (the tails of one
        chunk, longest first): a miss does not end the answer, and every key is asked;
        the answer counts the hits. Memory only on the calling thread."""
        keys = list(keys)
        clock = self.host.clock

        def job() -> int:
            n = 0
            for key in keys:
                if progress is not None and progress.cancelled:
                    break
                if self.host.indexed(key):
                    n += 1
                    continue
                missed = self._probe_misses.get(key)
                if not fresh and missed is not None and \
                        clock.monotonic() - missed < PROBE_MISS_TTL_S:
                    if alternatives:
                        continue
                    break
                if any(self._ask(lt.tier, key) for lt in self.lower):
                    n += 1
                    continue
                with self._parts_lock:
                    self._probe_misses[key] = clock.monotonic()
                    self._probe_misses.move_to_end(key)
                    while len(self._probe_misses) > PROBE_MISS_MAX:
                        self._probe_misses.popitem(last=False)
                if not alternatives:
                    break
            return n

        return self.probe_io.submit_store(job)

    def _ask(self, tier: SharedTier, key: ChunkKey) -> bool:
        """``tier.contains_prefix([key])`` under its breaker; False if it may not be asked."""
        try:
            with self._call(tier, read=True):
                return tier.contains_prefix([key]) == 1
        except TierUnavailable:
            return False

    @contextmanager
    def _call(self, tier: Tier, *, read: bool, nbytes: int = 0) -> Iterator[None]:
        """One call to a lower tier under its breaker, moving about ``nbytes``: raises
        ``TierUnavailable`` if the tier may not be called; a call that counted an error
        is a failure, and so is one slower than its allowance for those bytes. Only
        errors the call itself recorded (on this thread, foreground ops) count: a
        restamp, walk, expiry, collection or start scan failing meanwhile on another
        thread is not this call's fault."""
        breaker = self._breaker_of.get(id(tier))
        if breaker is None:
            yield
            return
        with breaker.call(read=read, nbytes=nbytes) as call:
            errors = tier.metrics.errors_here()
            yield
            if tier.metrics.errors_here() > errors:
                call.fail()

    def lookup(self, keys: Sequence[ChunkKey]) -> Lookup:
        """Authoritative lookup: may ask the tiers (I/O). IO threads and tools only."""
        n_host = self.host.contains_prefix(keys)
        where = [HOST] * n_host
        for key in keys[n_host:]:
            for i, tier in enumerate(self.tiers):
                if tier.contains_prefix([key]) == 1:
                    where.append(i)
                    break
            else:
                break
        return Lookup(tuple(keys[: len(where)]), tuple(where))

    # -- writes ------------------------------------------------------------------------
    def put(self, meta: ChunkMeta, payload: Any) -> bool:
        """Copy one chunk into the host tier. False if it was present or had to be dropped."""
        self.host.check_fits(meta)
        r = self.host.reserve(meta.key)
        if r is None:
            if not self.host.index.contains(meta.key):
                self._drop("host_full")
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

    def discard(self, keys: Sequence[ChunkKey]) -> int:
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
            self._queue_write(slot, meta, [tier], cleans=False, kind="write_through")
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
        with self._parts_lock:
            fresh = {k for k in keys if now - self._offered.get(k, -1e18) < min_age_s}
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

    def _mark_offered(self, keys: Sequence[ChunkKey]) -> None:
        now = self.host.clock.monotonic()
        with self._parts_lock:
            for k in keys:
                self._offered[k] = now
                self._offered.move_to_end(k)
            while len(self._offered) > OFFERED_MAX:
                self._offered.popitem(last=False)

    def _spill_if_needed(self) -> None:
        """Queue the coldest dirty chunks for spilling while free-or-clean slots, plus
        those being spilled, are below the low-water mark (at most ``spill_batch`` at a
        time). Memory only."""
        if not self._back:
            return
        with self._parts_lock:
            short = self._reserve_slots - self.host.index.clean_or_free() - self._spilling
        if short <= 0:
            return
        if not self.can_write_back():
            return  # every write-back tier is down: the chunks stay dirty (not lost)
        for slot, meta in self.host.index.take_dirty(min(short, self._spill_batch)):
            with self._parts_lock:
                self._spilling += 1
            fut = self._queue_write(slot, meta, self._back, cleans=True, held=True,
                                    kind="spill")
            if fut is None:
                with self._parts_lock:
                    self._spilling -= 1
            else:
                fut.add_done_callback(self._spilled)

    def _spilled(self, _: Future[Any]) -> None:
        """A spill ended (written or not): it no longer counts towards the mark."""
        with self._parts_lock:
            self._spilling -= 1

    def _queue_write(
        self,
        slot: int,
        meta: ChunkMeta,
        tiers: Sequence[Tier],
        *,
        cleans: bool,
        held: bool = False,
        kind: str,
    ) -> Future[Any] | None:
        """Queue a write of one host slot to ``tiers`` (``held``: the caller holds it once
        already), one job per tier's IO pool, each holding the slot until it is done; the
        result is True if every tier holds the chunk. With ``cleans`` (a spill or a
        write-back of a dirty chunk) see ``_queue_write_back``.

        ``None`` if the chunk was evicted first or no job could be queued (counted; the
        chunk is as it was: a full queue is not a failed write).

        With ``cleans`` see ``_queue_write_back``: there, one tier holding the chunk
        is enough.
        """
        if cleans:
            return self._queue_write_back(slot, meta, tiers, held=held, kind=kind)
        if not held and self.host.index.hold(meta.key) is None:
            return None  # evicted before we got to it
        groups: dict[int, tuple[IOPool, list[Tier]]] = {}
        for tier in tiers:
            pool = self._pool_of(tier)
            groups.setdefault(id(pool), (pool, []))[1].append(tier)
        for _ in range(len(groups) - 1):  # one hold per job; ours keeps the key in slot
            self.host.index.hold(meta.key)
        parts: list[Future[Any]] = []
        for pool, group in groups.values():

            def job(group: list[Tier] = group) -> bool:
                try:
                    return self._write_slot(slot, meta, group, kind)
                finally:
                    self.host.release(slot)

            fut = self._submit(job, kind, pool)
            if fut is None:
                self.host.release(slot)
            else:
                parts.append(fut)
        if not parts:
            return None
        whole: Future[Any] = Future()
        whole.set_running_or_notify_cancel()
        missing = len(parts) < len(groups)
        left = [len(parts)]

        def part_done(_: Future[Any]) -> None:
            with self._parts_lock:
                left[0] -= 1
                if left[0]:
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

    def _queue_write_back(
        self, slot: int, meta: ChunkMeta, tiers: Sequence[Tier], *, held: bool, kind: str,
    ) -> Future[Any] | None:
        """Queue a write of the dirty chunk in ``slot`` to the write-back ``tiers``, one
        job per tier's IO pool; the result is True once ONE tier holds the chunk.

        Each tier's trouble is its own (issue 32): the chunk is marked clean as soon as
        one tier has stored it, so a write-back tier that is down, hung or refusing
        writes never keeps host slots dirty while another one works. The tiers that
        did not get it give up that copy (counted as a drop, ``tier_down`` or
        ``gave_up_copy``): the chunk is read from the tier that holds it, and a later
        save of the same key writes it again. Tiers whose breaker refuses calls now are
        not queued at all (their pool may be stuck behind a hang).

        Holds: one *pin* on ``slot`` (the caller's, with ``held``) keeps the dirty chunk
        from being taken by another spill until it is clean or every tier failed; each
        job holds the chunk itself only while it runs, so a job queued behind a hung
        tier holds no host slot once the chunk is clean elsewhere (it then finds the
        chunk evicted and gives its copy up). The chunk is marked clean, or its write
        failure recorded, by the job while it still holds the slot. Every tier failing
        leaves the chunk dirty (nothing stored is lost) and restarts its age."""
        if not held and self.host.index.hold(meta.key) is None:
            return None  # evicted before we got to it
        groups: dict[int, tuple[IOPool, list[Tier]]] = {}
        for tier in tiers:
            b = self._breaker_of.get(id(tier))
            if b is not None and not (b.up or b.available()):
                self._drop("tier_down")
                continue
            pool = self._pool_of(tier)
            groups.setdefault(id(pool), (pool, []))[1].append(tier)
        whole: Future[Any] = Future()
        whole.set_running_or_notify_cancel()
        state = {"left": len(groups), "ok": False, "pinned": True}

        def settle(ok: bool, at: int | None) -> None:
            """One job is done (``at``: the slot it holds, None if it holds none)."""
            with self._parts_lock:
                state["left"] -= 1
                first_ok = ok and not state["ok"]
                state["ok"] = state["ok"] or ok
                last_failed = not state["left"] and not state["ok"]
                unpin = (first_ok or last_failed) and bool(state["pinned"])
                if unpin:
                    state["pinned"] = False
            where = slot if at is None else at
            if first_ok:
                self.host.index.mark_clean(where, meta.key)  # held: never reused here
            elif last_failed:
                self.host.index.write_failed(where, meta.key)
            if unpin:
                self.host.release(slot)
            if first_ok or last_failed:
                whole.set_result(first_ok)

        def job(group: list[Tier]) -> bool:
            got = self.host.index.hold(meta.key)
            if got is None:  # clean (another tier has it) and evicted since: give up
                self._drop("gave_up_copy")
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
                settle(False, None)  # the pin is still held if no job stored it yet
            else:
                queued += 1
        if not queued:
            return None
        self._inflight.add(whole)
        whole.add_done_callback(self._inflight.discard)
        return whole

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
                self._drop("tier_down")
                ok = False
                continue
            except Exception:
                self._job_failed(tier.name, kind)
                ok = False
                continue
            stored = status in (PutStatus.STORED, PutStatus.EXISTS)
            ok &= stored
            some |= stored
            if status is PutStatus.STORED:
                self._collect_later(tier)
        return ok if every else some

    def _collect_later(self, tier: Tier) -> None:
        """Queue one collection of ``tier`` (capacity) as its own job, outside any timed
        call, unless one is queued already: a big collection is not a slow write."""
        with self._parts_lock:
            if id(tier) in self._collecting:
                return
            self._collecting.add(id(tier))

        def job() -> int:
            with self._parts_lock:
                self._collecting.discard(id(tier))
            return tier.collect()

        try:
            fut = self._submit(job, "collect", self._pool_of(tier), count_drop=False)
        except IOPoolClosed:  # a write that ran on while the store closed: no collection
            fut = None
        if fut is None:
            with self._parts_lock:
                self._collecting.discard(id(tier))

    def _job_failed(self, tier: str, kind: str) -> None:
        """Count a store job that raised; log its traceback once per (tier, kind). Runs on
        an IO thread, inside the ``except`` that caught it."""
        self.store_errors += 1
        record_store_error(tier, kind)
        if (tier, kind) not in self._logged_errors:
            self._logged_errors.add((tier, kind))
            log.exception("kvtier: %s job on tier %s failed (logged once; counted in "
                          "kvtier_store_errors_total)", kind, tier)

    def _submit(
        self, job: Callable[[], Any], kind: str, pool: IOPool | None = None, *,
        count_drop: bool = True,
    ) -> Future[Any] | None:
        """Queue a store job on ``pool`` (default ``io``); ``None`` (and a counted drop)
        if its store queue is full. A job that raises is counted and logged (tier
        ``store``), never swallowed."""

        def guarded() -> Any:
            try:
                return job()
            except Exception:
                self._job_failed("store", kind)
                raise

        fut = (pool or self.io).submit_store(guarded)
        if fut is None:
            if count_drop:
                self._drop("store_queue_full")
            return None
        self._inflight.add(fut)
        fut.add_done_callback(self._inflight.discard)
        return fut

    def _drop(self, reason: str) -> None:
        self.drops += 1
        record_drop(reason)

    # -- reads -------------------------------------------------------------------------
    def load(
        self, found: Lookup, expect: ChunkSpec | Sequence[ChunkSpec] | None = None,
        progress: LoadProgress | None = None,
    ) -> Future[Held]:
        """Hold the chunks of ``found`` (a ``lookup_indexed`` or ``lookup`` answer, or its
        ``head``) in host slots, in order, promoting lower-tier entries into host slots.

        Each chunk is read from the tier ``found`` names: no tier is asked again where a
        key is. What changed since the lookup is checked, not trusted: a host entry lost
        meanwhile (evicted, or not what ``expect`` says), or an object gone from its tier
        (another node's collector, a corrupt object), is a counted miss there, then read
        from the next lower tier whose index knows it, if any; it ends the prefix when
        no tier below has the chunk. A chunk
        another load promoted meanwhile is served from the host. Leading host
        entries are held at once, on the calling thread; the rest are read on the IO pool
        (loads run before stores). With ``expect`` (one spec for every chunk, or one per
        entry of ``found``: a partial tail's differs), only chunks that match it are
        served: a host slot or object of another namespace, token count, dtype, shape or
        payload length is a counted miss. The future never raises for storage faults or
        bad objects: a chunk that cannot be read ends the prefix. If it raises anyway (a
        bug), it holds no slots. Each chunk is read on the IO pool of the tier it is read
        from (a run of chunks on one tier stays on that pool, then the load moves on to
        the next tier's pool): a hung tier holds only its own pool's threads, never
        another tier's. ``progress`` is touched after each chunk read; once cancelled, the load ends
        before its next chunk (what it holds by then is in the result).
        """
        specs: list[ChunkSpec | None]
        if expect is None or isinstance(expect, ChunkSpec):
            specs = [expect] * found.hits
        else:
            specs = list(expect)
            if len(specs) != found.hits:
                raise ValueError(f"{len(specs)} specs for {found.hits} chunks")
        for spec in [expect] if isinstance(expect, ChunkSpec) else specs:
            if spec is not None and spec.payload_len > self.host.slot_bytes:
                raise ValueError(
                    f"expected chunks of {spec.payload_len} bytes do not fit the host "
                    f"tier's {self.host.slot_bytes}-byte slots"
                )
        held = Held(self)
        entries = list(zip(found.keys, found.tiers, specs, strict=True))
        rest: list[_Entry] = []
        try:
            for i, (key, tier, spec) in enumerate(entries):
                if tier != HOST:
                    rest = entries[i:]
                    break
                got = self._hold_host(key, spec)
                if got is None:  # gone (or bad) since the lookup: read it below, or stop
                    alt = self._indexed_below(key)
                    rest = [] if alt is None else [(key, alt, spec), *entries[i + 1 :]]
                    break
                held.add(got)
            done: Future[Held] = Future()
            if not rest:
                done.set_result(held)
                return done
            self._hand_off(done, held, rest, progress)
            return done
        except BaseException:
            held.release()
            raise

    def _entry_pool(self, tier: int) -> IOPool:
        """The IO pool that reads from tier ``tier`` (host entries: the first pool)."""
        return self._pool_of(self.tiers[tier]) if tier != HOST else self.io

    def _hand_off(self, done: Future[Held], held: Held, entries: list[_Entry],
                  progress: LoadProgress | None) -> None:
        """Queue the rest of a load (``entries``, non-empty) on the pool of the tier its
        first chunk is read from; ``done`` gets the result. If the pool is closed (or
        cancels the job unstarted), the slots held so far are released and ``done``
        fails. Any thread."""
        pool = self._entry_pool(entries[0][1])
        try:
            job = pool.submit_load(partial(self._run_load, done, held, entries, progress,
                                           pool, time.perf_counter()))
        except BaseException as e:
            held.release()
            done.set_exception(e)
            return

        def unstarted(f: Future[None]) -> None:
            if f.cancelled():
                held.release()
                done.set_exception(IOPoolClosed("the load was cancelled before it ran"))

        job.add_done_callback(unstarted)

    def _run_load(self, done: Future[Held], held: Held, entries: list[_Entry],
                  progress: LoadProgress | None, pool: IOPool,
                  queued: float | None = None) -> None:
        """Read ``entries`` on ``pool`` (an IO thread) until one must be read from a tier
        served by another pool: hand the rest to that pool (so a hung tier holds only its
        own pool's threads, issue 32), else resolve ``done``. ``queued``: when the job
        was queued (the wait behind other loads or a running write is the ``queue``
        stage)."""
        if progress is not None and queued is not None:
            progress.waited("queue", time.perf_counter() - queued)
        try:
            rest = self._promote(held, entries, progress, pool)
        except BaseException as e:
            done.set_exception(e)  # _promote released what it held
            return
        if rest:
            self._hand_off(done, held, rest, progress)
        else:
            done.set_result(held)

    def _hold_host(self, key: ChunkKey, expect: ChunkSpec | None) -> _Hit | None:
        """Hold ``key``'s host slot: ``((slot, meta), HOST)``; a miss (evicted, or not
        what ``expect`` says) is counted."""
        got = self.host.hold(key, expect)
        if got is None:
            self.host.metrics.miss()
            return None
        return got, HOST

    def _indexed_below(self, key: ChunkKey, tier: int = HOST) -> int | None:
        """The first tier below ``tier`` whose breaker is up and whose index knows ``key``
        (memory only): where a chunk that ``tier`` lost since the lookup may still be
        read."""
        return next((i for i, (lt, b) in enumerate(zip(self.lower, self.breakers,
                                                       strict=True), start=1)
                     if i > tier and b.up and lt.tier.indexed(key)), None)

    def _promote(
        self, held: Held, entries: list[_Entry], progress: LoadProgress | None,
        pool: IOPool,
    ) -> list[_Entry]:
        """Read ``entries`` in order into ``held`` while each is read from a tier that
        ``pool`` serves (host entries anywhere); returns the entries left for another
        pool (a lower tier's chunk, or a fallback read below), empty when the load is
        done (every chunk, or a miss that ends the prefix, or cancelled)."""
        try:
            for i, (key, tier, expect) in enumerate(entries):
                if progress is not None and progress.cancelled:
                    break  # the caller gave up: read no more
                if tier != HOST and self._entry_pool(tier) is not pool:
                    return entries[i:]
                got = (self._hold_host(key, expect) if tier == HOST
                       else self._promote_one(key, tier, expect, progress))
                while got is None and (below := self._indexed_below(key, tier)) is not None:
                    tier = below  # lost where the lookup saw it: the next tier down
                    if self._entry_pool(tier) is not pool:
                        return [(key, tier, expect), *entries[i + 1:]]
                    got = self._promote_one(key, tier, expect, progress)
                if got is None:
                    break
                held.add(got)
                if progress is not None:
                    progress.touch()
        except BaseException:
            held.release()  # the caller gets the exception, and no slots to release
            raise
        return []

    def _promote_one(
        self, key: ChunkKey, tier_index: int, expect: ChunkSpec | None,
        progress: LoadProgress | None = None,
    ) -> _Hit | None:
        """Read ``key`` from tier ``tier_index`` (where the lookup found it) into a host
        slot and hold it: ``((slot, meta), tier it came from)``, or ``None`` if it cannot
        be had now (gone, bad, or the tier is down).

        A key another thread is filling now (another request's restore of a shared
        prefix, or a save) is waited for, in slices of ``SETTLE_SLICE_S``, until that
        fill ends or ``progress`` is cancelled (the scheduler gave this load up), then
        held; if the fill failed, it is read here."""
        tier = self.lower[tier_index - 1].tier
        t0 = time.perf_counter()
        r = self.host.reserve(key)
        cleaned = 0
        while r is None:  # promoted (or being written) meanwhile by someone else
            got = self._hold_host(key, expect)
            if got is None and not self.host.index.pending(key):
                # every slot is held or dirty: write a dirty one below now, on this IO
                # thread (a healthy tier takes milliseconds), and take its slot
                if cleaned < CLEAN_MAX and not (progress and progress.cancelled) and \
                        self._clean_one(progress):
                    cleaned += 1
                    r = self.host.reserve(key)
                    continue
                record_drop("restore_no_slot")
                self._spill_if_needed()
                return None
            if got is not None:
                return got
            settling = time.perf_counter()
            while not self.host.wait_settled(key, SETTLE_SLICE_S):
                if progress is not None and progress.cancelled:
                    progress.waited("settle", time.perf_counter() - settling)
                    return None
                if progress is None and time.perf_counter() - t0 > SETTLE_MAX_S:
                    return None
            if progress is not None:
                progress.waited("settle", time.perf_counter() - settling)
            r = self.host.reserve(key)
        nbytes = expect.payload_len if expect is not None else self.host.slot_bytes
        reading = time.perf_counter()
        try:
            with self._call(tier, read=True, nbytes=nbytes):
                filled = self._fill(r.slot, key, tier, expect)
        except TierUnavailable:
            self.host.abort(r.slot)
            return None
        finally:
            if progress is not None:
                progress.waited("read", time.perf_counter() - reading)
        if not filled:
            return None
        got = self._hold_host(key, expect)
        if got is not None and self.on_read is not None:
            # verified hits only: what a restore really costs
            self.on_read(tier.name, got[0][1].payload_len, time.perf_counter() - t0)
        return None if got is None else (got[0], tier_index)

    def _clean_one(self, progress: LoadProgress | None) -> bool:
        """IO threads only: write the coldest dirty, unheld host chunk to the write-back
        tiers now and mark it clean (evictable), for a promotion that found every slot
        held or dirty; the time is the load's ``slot`` stage. False if there is no such
        chunk, no write-back tier may be written, or the write failed (the chunk stays
        dirty)."""
        # one write-back tier whose breaker is closed: a chunk is clean once ONE tier
        # holds it (issue 32), and a tier that is down is never written from a load's
        # thread
        up = [t for t in self._back if (b := self._breaker_of.get(id(t))) is None or b.up]
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

    def _fill(self, slot: int, key: ChunkKey, tier: Tier, expect: ChunkSpec | None) -> bool:
        """Read ``key`` from ``tier`` into the WRITING ``slot``; commit it (clean, with the
        meta the tier verified) if the tier returned verified bytes, else abort it. The
        slot is never left WRITING."""
        try:
            meta = tier.get_into(key, self.host.view(slot).data, expect=expect)
        except BaseException:
            self.host.abort(slot)
            raise
        if meta is None:
            self.host.abort(slot)
            return False
        self.host.commit(slot, meta, dirty=False)  # aborts and raises if it cannot
        return True

    def get_into(
        self, key: ChunkKey, dst: memoryview, expect: ChunkSpec | None = None
    ) -> ChunkMeta | None:
        """Synchronous read of one chunk from the highest tier that has it (an authoritative
        ``lookup``: may do I/O; IO threads and tools only)."""
        held = self.load(self.lookup([key]), expect).result()
        try:
            if not held.slots:
                return None
            meta = held.slots[0][1]
            np.copyto(np.frombuffer(dst, dtype=np.uint8, count=meta.payload_len), held.view(0))
            return meta
        finally:
            held.release()

    # -- life cycle --------------------------------------------------------------------
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
        if not self._back:
            return {}
        jobs: dict[Future[Any], ChunkKey] = {}
        batch = self.host.index.take_dirty(max_n, hottest_first=True, skip=skip,
                                           older_than=older_than)
        for i, (slot, meta) in enumerate(batch):
            fut = self._queue_write(slot, meta, self._back, cleans=True, held=True,
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
