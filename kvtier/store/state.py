"""``StoreState``: what every part of ``TieredStore`` shares (tiers, IO pools, breakers,
counters) and the plumbing they all use (which pool serves a tier, one breaker-guarded
call, one queued job, one counted drop). The parts (``writeback``, ``writes``, ``reads``,
``upkeep``) add behaviour only; every field lives here, so the lock rules below are the
whole story.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

from kvtier.config import HealthConfig
from kvtier.health import Breaker, breakers_for
from kvtier.iopool import IOPool
from kvtier.keys import ChunkKey
from kvtier.metrics import record_drop, record_store_error
from kvtier.store.types import LoadProgress, LowerTier, WritePolicy
from kvtier.tiers.base import Tier
from kvtier.tiers.host import HostTier

log = logging.getLogger("kvtier.store")

#: Probes waiting for a probe thread before ``probe`` refuses more.
PROBE_QUEUE = 64


class StoreState:
    """The fields of a ``TieredStore``, and who may touch them from which thread.

    Threads. *vLLM's scheduler thread* calls the memory-only API (``lookup_indexed``,
    ``can_probe``/``probe``, ``reserve``/``holds``/``saving``/``commit``/``abort``/
    ``delete``, ``put``, ``load``, ``rewrite_through``, ``drop_host``/``empty_host``, the
    health questions below): none of them does I/O there, they only queue jobs. *IO pool
    threads* (``io`` and each lower tier's pool in ``tier_io``) run those jobs: a load's
    promotions, every write to a lower tier, collections. *Probe threads*
    (``probe_io``) run probes. *Future callbacks* (a spill ending, a fan-out's part ending,
    a load's job cancelled unstarted) run on whichever thread completes the future: an IO
    thread, or the caller if it was done already. ``lookup`` and ``get_into`` may do I/O
    on the calling thread: IO threads and tools only. ``flush``/``flush_dirty``/
    ``shutdown``/``close`` wait: a stopping engine's thread or the idle flusher's.

    Locks.

    * ``_lock`` (this store's one lock, never held across I/O or a call into a lower
      tier; the host index's lock may be taken inside it, never the other way round)
      guards ``_probe_misses``, ``_offered``, ``_refreshed``, ``_spilling``, ``_collecting`` and the
      counts a write fan-out keeps while its parts end on several IO threads.
    * The host tier's slot index has its own lock: slot states, holds and dirty bits
      (``host.index.*``) may be asked and changed from any thread; a slot the caller
      holds is never reused under it.
    * Each ``Breaker`` and ``IOPool`` locks itself.
    * ``_inflight`` (futures of queued writes, for ``flush``) has no lock: it is only
      added to, discarded from (done callbacks) and copied (``list``), each one atomic
      under the GIL.
    * ``drops``, ``store_errors`` and ``_logged_errors`` are bumped from any thread
      without a lock (counters for metrics and tests; a message may be logged twice).
    * Everything else (``host``, ``lower``, ``breakers``, the pools, ``_back``,
      ``_through``, ``on_read``) is set before the store is used and never changed.
    """

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
        self._refreshed: OrderedDict[ChunkKey, float] = OrderedDict()  # host hit -> when
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
        #: write-through jobs queued or running that hold their host slot, by pool
        #: (``Writes._queue_write``), and how many each pool may have
        self._through_holds: dict[int, int] = {}
        self._through_cap = max(1, host.pool.num_slots // 2)
        #: pool -> token -> when a held job was queued, until it starts (``_may_hold``)
        self._through_waiting: dict[int, dict[int, float]] = {}
        self._through_token = 0
        for lt in self.lower:
            if hasattr(lt.tier, "collect_on_put"):
                setattr(lt.tier, "collect_on_put", False)  # noqa: B010 - _collect_later
        self._lock = threading.Lock()
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

    # -- IO pools ----------------------------------------------------------------------
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

    # -- health: memory-only questions any thread may ask -------------------------------
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

    def can_probe(self, stalled_s: float | None = None) -> bool:
        """Memory only: would ``probe`` ask any lower tier now? (No tier, every tier
        down, or every tier at its read bound: asking would only queue behind a hang.)
        With ``stalled_s``, a tier with a read overdue by that long (``Breaker.overdue``:
        it is not answering now) is not asked either."""
        return any(b.available() and not (stalled_s is not None
                                          and b.overdue(stalled_s, reads=True))
                   for b in self.breakers)

    def stalled(self, progress: LoadProgress, seconds: float) -> bool:
        """Memory only: has a read of a tier that ``progress``'s load or probe may wait on
        (``LoadProgress.tiers``) been running for ``seconds`` plus its bytes' allowance
        (``Breaker.overdue``; writes are left out: a busy filesystem's fsync is slow)? A
        load idle for that long behind healthy IO (other loads, a write) is queued, not
        hung; this tells the two apart (``kvtier.vllm.waitbound``)."""
        return any(self.breakers[t - 1].overdue(seconds, reads=True)
                   for t in progress.tiers if 0 < t <= len(self.breakers))

    def indexes_filling(self) -> bool:
        """Memory only: some lower tier's start scan is still running, so its index does
        not know everything it holds yet (the first seconds after a restart)."""
        return any(not getattr(lt.tier, "index_ready", True) for lt in self.lower)

    # -- plumbing every part uses --------------------------------------------------------
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
                self._count_drop("store_queue_full")
            return None
        self._inflight.add(fut)
        fut.add_done_callback(self._inflight.discard)
        return fut

    def _job_failed(self, tier: str, kind: str) -> None:
        """Count a store job that raised; log its traceback once per (tier, kind). Runs on
        an IO thread, inside the ``except`` that caught it."""
        self.store_errors += 1
        record_store_error(tier, kind)
        if (tier, kind) not in self._logged_errors:
            self._logged_errors.add((tier, kind))
            log.exception("kvtier: %s job on tier %s failed (logged once; counted in "
                          "kvtier_store_errors_total)", kind, tier)

    def _count_drop(self, reason: str) -> None:
        """Count a write that was not done (``kvtier_drops_total{reason}``)."""
        self.drops += 1
        record_drop(reason)
