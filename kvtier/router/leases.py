"""Lease upkeep for the router: renew the chains of tracked conversations, collect
objects past their lease, on demand and on a heartbeat.

Invariants:

* Blocking lease work (renewal, collection) runs on the keeper's own lease threads
  (``kvtier.router.storage.BoundedExecutor``), never on the loop nor on asyncio's default
  executor; a renewal is waited for at most ``LEASE_CALL_TIMEOUT_S``, a collection at
  most a beat, and no collection starts while the last has not returned.
* One heartbeat (``beat_once``) renews the chains of live conversations, then runs the
  collector, if there is one, to remove objects past their lease. A failure is logged and
  the heartbeat goes on; a heartbeat never stops the router.
* A heartbeat's renewal is bounded: conversations go least recently renewed first, at most
  ``concurrency`` at once, and none is started once ``budget`` seconds (of the injected
  clock) have passed since the beat began; those not reached are counted as deferred and
  go first next beat. So a beat lasts at most ``budget`` plus one renewal, whatever the
  number of conversations, and a conversation is never starved (its renewal time only
  grows older until it is first in line).
* A live conversation whose chain was not renewed (nor written) for ``lease_seconds`` is
  counted once as lapsed (``kvtier_router_leases_lapsed_total``): its oldest chunks may
  have been collected. Its KV stays correct; a cut chain is a shorter prefix.
* Everything here runs on the event loop's thread but the renewer and collector calls.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass

from aiohttp import web

from kvtier.clock import Clock
from kvtier.router import DEFAULT_RENEW_CONCURRENCY
from kvtier.router.conversations import ConversationMap, ConversationState
from kvtier.router.metrics import RouterMetrics
from kvtier.router.protocol import RouterError
from kvtier.router.storage import BoundedExecutor
from kvtier.tiers.base import TierError

log = logging.getLogger(__name__)

ChainRenewer = Callable[[str], int]  # last_key_hex -> chunks renewed; blocking
Collector = Callable[[], int]  # removes objects past their lease -> how many; blocking


#: A renewal waited for at most this long (``POST /v1/kvtier/renew``, each one of a
#: heartbeat's): a chain of thousands of chunks on S3 takes seconds; a tier that hangs
#: then costs the caller this once, and its breaker skips the tier from then on.
LEASE_CALL_TIMEOUT_S = 10.0
#: A heartbeat skips a chain renewed or written within this fraction of the lease.
FRESH_FRACTION = 0.25


class _Busy(Exception):
    """Every lease thread is busy."""


class RenewLimiter:
    """A token bucket per caller (a tenant; ``None`` without tenants) for
    ``POST /v1/kvtier/renew``: ``rate`` calls a second, bursts of ``4 * rate``. A renewal
    walks a whole chain (three requests a chunk on S3), so one caller may not spend the
    tier's capacity that the others' renewals and restores need. Event loop thread
    only; time from the caller."""

    BURST = 4.0
    #: callers remembered at most (a full bucket is forgotten first)
    MAX_CALLERS = 65536

    def __init__(self, rate: float) -> None:
        if rate <= 0:
            raise ValueError(f"renew rate must be > 0, got {rate}")
        self.rate, self.burst = rate, max(1.0, self.BURST * rate)
        self._buckets: dict[str | None, tuple[float, float]] = {}  # caller -> (tokens, at)

    def take(self, caller: str | None, now: float) -> float | None:
        """Spend one call of ``caller``'s at ``now``: None if allowed, else the seconds
        until one is."""
        tokens, at = self._buckets.get(caller, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        if tokens < 1:
            self._buckets[caller] = (tokens, now)
            return (1 - tokens) / self.rate
        self._buckets[caller] = (tokens - 1, now)
        if len(self._buckets) > self.MAX_CALLERS:
            self._buckets.pop(next(iter(self._buckets)))
        return None


@dataclass(frozen=True)
class Beat:
    """What one heartbeat did."""

    renewed: int  # chunks whose lease was renewed
    expired: int  # objects the collector removed


class LeaseKeeper:
    """Renews the tracked conversations' chains and collects what is past its lease (see the
    module invariants). Without a renewer or collector, that part is off."""

    def __init__(self, conversations: ConversationMap, metrics: RouterMetrics,
                 interval: float, renewer: ChainRenewer | None,
                 collector: Collector | None, *, clock: Clock, lease_seconds: float,
                 concurrency: int = DEFAULT_RENEW_CONCURRENCY,
                 budget: float | None = None, executor: BoundedExecutor | None = None,
                 call_timeout: float = LEASE_CALL_TIMEOUT_S) -> None:
        if concurrency < 1:
            raise ValueError(f"renew concurrency must be >= 1, got {concurrency}")
        self.conversations, self.metrics, self.interval = conversations, metrics, interval
        self.renewer, self.collector = renewer, collector
        self.clock, self.lease_seconds = clock, lease_seconds
        self.concurrency = concurrency
        self.budget = interval / 2 if budget is None else budget  # seconds per beat
        self._lapsed: set[str] = set()  # counted as lapsed, not renewed since
        #: renewals and collection run here, never on asyncio's default executor (which
        #: aiohttp's DNS resolution and the tenants-file refresh use): a hung tier holds
        #: at most its threads, and a call finding them all busy is refused
        self.executor = executor or BoundedExecutor(concurrency + 1, "lease")
        self.call_timeout = call_timeout
        self._collecting: Future[int] | None = None

    async def _run(self, fn: Callable[[str], int], arg: str) -> int:
        """``fn(arg)`` on a lease thread, waited for at most ``call_timeout`` seconds (the
        thread itself ends when its tier answers); ``_Busy`` if no thread is free."""
        fut = self.executor.submit(fn, arg)
        if fut is None:
            raise _Busy
        return await asyncio.wait_for(asyncio.wrap_future(fut), self.call_timeout)

    async def renew_chain(self, cid: str, last_key: str | None) -> int:
        """Renew the chain ending at ``last_key`` now; returns chunks renewed. Raises
        ``RouterError``: 501 without a renewer, 502 if the tiers failed."""
        if self.renewer is None:
            raise RouterError(501, "lease renewal needs the router started with --tiers",
                              "not_implemented_error")
        if last_key is None:
            return 0
        try:
            renewed = await self._run(self.renewer, last_key)
        except _Busy:
            raise RouterError(503, f"renewing conversation {cid!r}: every lease thread is "
                              "busy (a shared tier is not answering); try again later",
                              "service_unavailable") from None
        except TimeoutError:
            raise RouterError(504, f"renewing conversation {cid!r} took over "
                              f"{self.call_timeout:g} s (a shared tier is not answering)",
                              "timeout") from None
        except ImportError as e:
            raise RouterError(501, f"lease renewal is unavailable: {e}",
                              "not_implemented_error") from None
        except (TierError, OSError, ValueError) as e:  # ValueError: a malformed last_key
            raise RouterError(502, f"renewing conversation {cid!r} failed: {e}",
                              "backend_error") from None
        self.metrics.renewed.inc(renewed)
        return renewed

    async def renew_all(self) -> int:
        """One heartbeat's renewal (bounded: see the module invariants); returns chunks
        renewed. A failure is logged and the next conversation is tried (the heartbeat must
        go on); without a renewer (501) the beat stops."""
        t0 = time.perf_counter()
        start = self.clock.monotonic()
        live = sorted(self.conversations.live(), key=lambda item: item[1].renewed)
        self._count_lapsed(live, start)
        # a chain renewed (or written) within a quarter lease is not renewed again yet
        order = [(cid, st) for cid, st in live
                 if start - st.renewed >= self.lease_seconds * FRESH_FRACTION]
        pending: Iterator[tuple[str, ConversationState]] = iter(order)
        deadline, stop = start + self.budget, False
        done = 0
        chains: dict[str, asyncio.Future[int]] = {}  # last key -> its renewal this beat

        async def renew_once(cid: str, last_key: str | None) -> int:
            """Conversations ending in the same chunk share one renewal a beat."""
            if last_key is None:
                return await self.renew_chain(cid, None)
            shared = chains.get(last_key)
            if shared is not None:
                await asyncio.shield(shared)
                return 0  # counted once, by the first
            fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            chains[last_key] = fut
            try:
                n = await self.renew_chain(cid, last_key)
            except BaseException as e:
                fut.set_exception(e)
                fut.exception()  # retrieved: the sharers see it through their own await
                raise
            fut.set_result(n)
            return n

        async def worker() -> int:
            nonlocal stop, done
            renewed = 0
            for cid, state in pending:  # one iterator shared by the workers
                if stop or self.clock.monotonic() >= deadline:
                    break
                done += 1
                try:
                    n = await renew_once(cid, state.last_key)
                except RouterError as e:
                    log.warning("lease heartbeat: %s", e.message)
                    stop = stop or e.status == 501
                    continue
                shared = state.last_key is not None and chains[state.last_key].result() > 0
                if n == 0 and not shared and state.last_key is not None:
                    # nothing of its chain was found: it is not renewed, it lapsed
                    if cid not in self._lapsed:
                        self._lapsed.add(cid)
                        self.metrics.lapsed.inc()
                    continue
                renewed += n
                self.conversations.mark_renewed(cid, self.clock.monotonic())
                self._lapsed.discard(cid)
            return renewed

        total = sum(await asyncio.gather(*(worker() for _ in range(self.concurrency))))
        if not stop and done < len(order):
            self.metrics.renew_deferred.inc(len(order) - done)
            log.info("lease heartbeat: %d of %d conversations left for the next beat "
                     "(budget %.3gs)", len(order) - done, len(order), self.budget)
        self.metrics.heartbeat.observe(time.perf_counter() - t0)
        return total

    def _count_lapsed(self, order: list[tuple[str, ConversationState]], now: float) -> None:
        live = {cid for cid, _ in order}
        self._lapsed &= live  # forget the ones that are gone
        for cid, state in order:
            if now - state.renewed < self.lease_seconds:
                break  # sorted by renewal: the rest are fresher
            if cid not in self._lapsed:
                self._lapsed.add(cid)
                self.metrics.lapsed.inc()

    async def collect(self) -> int:
        """Run the collector once; returns objects removed (0 without one, or on failure,
        which is logged: the heartbeat must go on)."""
        if self.collector is None:
            return 0
        if self._collecting is not None and not self._collecting.done():
            log.warning("lease collector: the last run has not returned (a shared tier "
                        "is not answering); not starting another")
            return 0
        fut = self.executor.submit(self.collector)
        if fut is None:
            log.warning("lease collector: every lease thread is busy; retrying next "
                        "heartbeat")
            return 0
        self._collecting = fut
        try:
            # a collection walks the whole tier: it may take the whole beat, not longer
            removed = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)),
                                             max(self.call_timeout, self.interval))
        except TimeoutError:
            log.warning("lease collector still running after %.0f s; the heartbeat goes "
                        "on", max(self.call_timeout, self.interval))
            return 0
        except (TierError, OSError, ImportError) as e:
            log.warning("lease collector failed; retrying next heartbeat: %s", e)
            return 0
        self.metrics.expired.inc(removed)
        return removed

    async def beat_once(self) -> Beat:
        """One heartbeat: renew every live conversation's chain, then collect what is past
        its lease."""
        renewed = await self.renew_all() if self.renewer is not None else 0
        return Beat(renewed, await self.collect())

    async def heartbeat(self, _app: web.Application) -> AsyncIterator[None]:
        beating = self.renewer is not None or self.collector is not None
        task = asyncio.create_task(self._beat()) if beating else None
        yield
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                beat = await self.beat_once()
            except Exception:  # the heartbeat must outlive any one failure
                log.exception("lease heartbeat failed; retrying next period")
                continue
            log.debug("lease heartbeat renewed %d chunks, expired %d objects",
                      beat.renewed, beat.expired)
