"""Lease upkeep for the router: renew the chains of tracked conversations, collect
objects past their lease, on demand and on a heartbeat.

Invariants:

* Blocking lease work (renewal, collection) runs in a worker thread (``asyncio.to_thread``),
  never on the loop.
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
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from kvtier.clock import Clock
from kvtier.router import DEFAULT_RENEW_CONCURRENCY
from kvtier.router.conversations import ConversationMap, ConversationState
from kvtier.router.metrics import RouterMetrics
from kvtier.router.protocol import RouterError
from kvtier.tiers.base import TierError

log = logging.getLogger(__name__)

ChainRenewer = Callable[[str], int]  # last_key_hex -> chunks renewed; blocking
Collector = Callable[[], int]  # removes objects past their lease -> how many; blocking


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
                 budget: float | None = None) -> None:
        if concurrency < 1:
            raise ValueError(f"renew concurrency must be >= 1, got {concurrency}")
        self.conversations, self.metrics, self.interval = conversations, metrics, interval
        self.renewer, self.collector = renewer, collector
        self.clock, self.lease_seconds = clock, lease_seconds
        self.concurrency = concurrency
        self.budget = interval / 2 if budget is None else budget  # seconds per beat
        self._lapsed: set[str] = set()  # counted as lapsed, not renewed since

    async def renew_chain(self, cid: str, last_key: str | None) -> int:
        """Renew the chain ending at ``last_key`` now; returns chunks renewed. Raises
        ``RouterError``: 501 without a renewer, 502 if the tiers failed."""
        if self.renewer is None:
            raise RouterError(501, "lease renewal needs the router started with --tiers",
                              "not_implemented_error")
        if last_key is None:
            return 0
        try:
            renewed = await asyncio.to_thread(self.renewer, last_key)
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
        order = sorted(self.conversations.live(), key=lambda item: item[1].renewed)
        self._count_lapsed(order, start)
        pending: Iterator[tuple[str, ConversationState]] = iter(order)
        deadline, stop = start + self.budget, False
        done = 0

        async def worker() -> int:
            nonlocal stop, done
            renewed = 0
            for cid, state in pending:  # one iterator shared by the workers
                if stop or self.clock.monotonic() >= deadline:
                    break
                done += 1
                try:
                    renewed += await self.renew_chain(cid, state.last_key)
                except RouterError as e:
                    log.warning("lease heartbeat: %s", e.message)
                    stop = stop or e.status == 501
                    continue
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
        try:
            removed = await asyncio.to_thread(self.collector)
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


class TierRenewer:
    """Renews lease chains on, and collects expired objects from, the shared tiers of a
    kvtier config (blocking; call it from a worker thread). ``kvtier.lease`` is imported on
    first use."""

    def __init__(self, config: Path, clock: Clock) -> None:
        from kvtier.build import build_lower_tiers
        from kvtier.config import load_config

        cfg = load_config(config)
        self.chunk_tokens = cfg.chunk_tokens  # the engines' (they share this config)
        self.tiers = [lt.tier for lt in build_lower_tiers(cfg, clock)]

    def __call__(self, last_key_hex: str) -> int:
        from kvtier.lease import renew_chain

        renewed: int = renew_chain(self.tiers, last_key_hex)
        return renewed

    def expire(self, lease_seconds: float) -> int:
        """Remove every object not used or renewed for ``lease_seconds``; returns count."""
        from kvtier.lease import expire_all

        removed: int = expire_all(self.tiers, lease_seconds)
        return removed

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
