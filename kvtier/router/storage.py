"""The shared tiers as the router uses them: nothing a tier does can stall the router.

The router reads the shared tiers to price a turn (``prefix.HeldLookup``), renews the
chains of the conversations it tracks and collects what is past its lease
(``leases``). A hung NFS mount blocks a thread in ``lstat`` for as long as it hangs and a
frozen S3 endpoint holds one for its retries; before this module those calls ran on
asyncio's default executor, which aiohttp's DNS resolution and the tenants-file refresh
share, so a few dozen hung probes froze every request and ``/health`` (issue 44, review
part 2). Now:

* **Start never waits on storage.** The tiers open on threads of their own
  (``kvtier.build.open_lower_tiers``); one that has not answered within
  ``OPEN_BOUND_S`` is a ``LateTier`` that answers "not held" until it opens, and one
  whose opening fails (an S3 endpoint that is down) is retried with a growing pause
  (``REOPEN_MIN_S`` to ``REOPEN_MAX_S``), each failure logged, instead of ending the
  router: P/D is served without the tier meanwhile.
* **A breaker per tier** (``kvtier.health.Breaker``, configured by the tiers config's
  ``health`` section, as the engines' are): every probe, renewal and metadata read is
  one breaker call, and a tier that is down, or has a call overdue by the breaker's
  ``stuck_s``, is not asked at all (its answer is "not held" / "not renewed", which only
  undercounts). Collection walks a whole tier, far longer than any call's allowance, so
  it is not a breaker call: it is skipped while the breaker refuses.
* **Executors of the router's own**, none shared with the event loop's other work:
  ``probes`` (``PROBE_THREADS``) and ``leases`` (renewals and collection). A submission
  finding every thread of its executor busy is refused (``BoundedExecutor.submit``
  returns None), never queued behind a hang: a turn is then priced from the index alone.

Threads: ``GuardedTier``'s calls and ``BoundedExecutor.submit`` may be made from any
thread; ``RouterTiers`` is built and closed on the event loop's thread (or before it
runs).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from kvtier.clock import Clock
from kvtier.health import Breaker, TierState, TierUnavailable, breakers_for
from kvtier.keys import ChunkKey
from kvtier.objformat import ChunkMeta
from kvtier.tiers.base import SharedTier, TierError
from kvtier.tiers.late import LateTier

log = logging.getLogger(__name__)

#: How long the router's start waits for the shared tiers to open before it serves
#: without the ones that have not (they join when they answer).
OPEN_BOUND_S = 2.0
#: Pauses between two tries to open a tier whose opening failed.
REOPEN_MIN_S = 1.0
REOPEN_MAX_S = 60.0
#: Probe threads: each held-prefix probe of a turn takes one for at most the router's
#: ``probe_timeout`` when the tier answers; a hung tier holds at most these many.
PROBE_THREADS = 4

P = ParamSpec("P")
T = TypeVar("T")


class BoundedExecutor:
    """Daemon threads that refuse work instead of queueing it once every thread is busy:
    a hung tier holds at most ``threads`` threads, nothing waits behind them, and a
    thread stuck in a hung mount never holds up the router's exit (a
    ``ThreadPoolExecutor`` joins its threads at exit)."""

    def __init__(self, threads: int, name: str) -> None:
        if threads < 1:
            raise ValueError(f"{name}: threads must be >= 1, got {threads}")
        self.threads = threads
        self.name = name
        self._lock = threading.Lock()
        self._work: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._busy = 0
        self._started = 0
        self._closed = False
        self.refused = 0

    @property
    def busy(self) -> int:
        with self._lock:
            return self._busy

    def submit(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> Future[T] | None:
        """Run ``fn`` on a free thread; None (nothing runs) if every thread is busy or
        the executor is shut down."""
        with self._lock:
            if self._closed or self._busy >= self.threads:
                self.refused += 1
                return None
            self._busy += 1
            start = self._started < self._busy
            if start:
                self._started += 1
        fut: Future[T] = Future()

        def run() -> None:
            try:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(*args, **kwargs))
                    except BaseException as e:  # delivered to whoever waits on it
                        fut.set_exception(e)
            finally:
                with self._lock:
                    self._busy -= 1

        self._work.put(run)
        if start:
            threading.Thread(target=self._worker, daemon=True,
                             name=f"kvtier-router-{self.name}").start()
        return fut

    def _worker(self) -> None:
        while True:
            job = self._work.get()
            if job is None:
                return
            job()

    def shutdown(self) -> None:
        """Stop taking work; idle threads end, threads stuck in a hung tier end when it
        answers (they are daemons)."""
        with self._lock:
            self._closed = True
            started = self._started
        for _ in range(started):
            self._work.put(None)


class GuardedTier:
    """One shared tier's calls under its breaker. A call the breaker refuses, or one that
    fails, answers as if the tier did not hold the key (the router then undercounts,
    which costs a prefill hop, never a wrong answer)."""

    def __init__(self, tier: SharedTier, breaker: Breaker) -> None:
        self.tier = tier
        self.breaker = breaker

    @property
    def name(self) -> str:
        return self.tier.name

    def usable(self) -> bool:
        """Memory only: would a call be made now? Not while the breaker refuses reads or
        any call to the tier has run ``stuck_s`` past its allowance (a hang shows here
        before it trips the breaker)."""
        b = self.breaker
        return b.available() and not b.overdue(b.stuck_s)

    def state(self) -> str:
        """``opening`` (a late tier not open yet), ``up`` or ``down`` (for ``/health``; a
        tier that opened late or went down is ``down`` until its breaker's next trial
        call, the next probe or renewal, succeeds)."""
        if isinstance(self.tier, LateTier) and not self.tier.ready:
            return "opening"
        return "up" if self.breaker.state is TierState.UP and self.usable() else "down"

    def indexed(self, key: ChunkKey) -> bool:
        """Memory only: does this node's index of the tier know ``key``?"""
        return self.tier.indexed(key)

    def _guarded(self, read: bool, fn: Callable[[], T], refused: T) -> T:
        if not self.usable():
            return refused
        try:
            with self.breaker.call(read=read):
                return fn()
        except TierUnavailable:
            return refused
        except (TierError, OSError) as e:  # counted by the breaker as a failed call
            log.debug("router: tier %s: %s", self.name, e)
            return refused

    def stored(self, key: ChunkKey) -> bool:
        """Is ``key`` stored in the tier? One lookup of the store itself, never this
        router's index of it (which learns of the engines' collection late)."""
        return self._guarded(True, lambda: self.tier.present(key), False)

    def renew(self, key: ChunkKey) -> bool:
        return self._guarded(False, lambda: self.tier.renew(key), False)

    def read_meta(self, key: ChunkKey) -> ChunkMeta | None:
        return self._guarded(True, lambda: self.tier.read_meta(key), None)

    def expire(self, lease_seconds: float) -> int:
        """Collect what is past its lease: a walk of the whole tier, not one call, so it is
        only skipped while the breaker refuses (a hung walk holds one lease thread)."""
        if not self.usable():
            return 0
        return self.tier.expire(lease_seconds)


def _open_retrying(opener: Callable[[Any, int, Clock], SharedTier], closed: threading.Event,
                   spec: Any, index: int, clock: Clock) -> SharedTier:
    """``opener(spec, index, clock)``, tried again after each failure with a growing pause
    until it opens or ``closed`` is set (then the last error is raised)."""
    pause = REOPEN_MIN_S
    while True:
        try:
            return opener(spec, index, clock)
        except Exception as e:
            if closed.is_set():
                raise
            log.error("router: shared tier %d did not open (%s); serving without it and "
                      "trying again in %.0f s", index, e, pause)
            if closed.wait(pause):
                raise
            pause = min(REOPEN_MAX_S, pause * 2)


class RouterTiers:
    """The shared tiers of a kvtier config, opened without waiting on them, each behind
    its breaker, with the executors every call to them runs on (module docstring)."""

    def __init__(self, config: Path, clock: Clock, *, open_bound_s: float | None = None,
                 probe_threads: int = PROBE_THREADS, lease_threads: int = 4,
                 opener: Callable[[Any, int, Clock], SharedTier] | None = None) -> None:
        from kvtier.build import build_lower, open_lower_tiers
        from kvtier.config import load_config

        cfg = load_config(config)
        open_bound_s = OPEN_BOUND_S if open_bound_s is None else open_bound_s
        self.chunk_tokens = cfg.chunk_tokens  # the engines' (they share this config)
        self._closed = threading.Event()
        retrying = partial(_open_retrying, opener or build_lower, self._closed)
        lower, late = open_lower_tiers(cfg, clock, open_bound_s, retrying)
        names = [lt.tier.name for lt in lower]
        breakers = breakers_for(names, cfg.health, probe_threads + 1, clock)
        for lt, breaker in zip(lower, breakers, strict=True):
            if lt.tier.name in late:
                assert isinstance(lt.tier, LateTier)
                breaker.start_down(f"opening {lt.tier.where} did not answer within "
                                   f"{open_bound_s:g} s at the router's start")
                log.warning("router: shared tier %s (%s) is not open yet; pricing and "
                            "leases go without it until it answers", lt.tier.name,
                            lt.tier.where)
        self.tiers = [GuardedTier(lt.tier, b) for lt, b in zip(lower, breakers, strict=True)]
        self.probes = BoundedExecutor(probe_threads, "probe")
        self.leases = BoundedExecutor(lease_threads, "lease")

    def states(self) -> dict[str, str]:
        """Each tier's ``GuardedTier.state`` (memory only)."""
        return {t.name: t.state() for t in self.tiers}

    def renew_chain(self, last_key_hex: str) -> int:
        """Blocking (a lease thread): renew the chain ending at ``last_key_hex`` in every
        usable tier that holds it; chunks renewed."""
        from kvtier.lease import renew_chain

        return renew_chain(self.tiers, last_key_hex)

    def expire(self, lease_seconds: float) -> int:
        """Blocking (a lease thread): collect every usable tier; objects removed."""
        return sum(t.expire(lease_seconds) for t in self.tiers)

    def close(self) -> None:
        self._closed.set()
        self.probes.shutdown()
        self.leases.shutdown()
        for t in self.tiers:
            t.tier.close()


def guarded(tiers: Sequence[SharedTier], clock: Clock) -> list[GuardedTier]:
    """``tiers`` each behind a default breaker (tests and tools that hold tiers already)."""
    from kvtier.config import HealthConfig

    names = [t.name for t in tiers]
    return [GuardedTier(t, b) for t, b in zip(
        tiers, breakers_for(names, HealthConfig(), PROBE_THREADS + 1, clock), strict=True)]
