"""Tier health: a circuit breaker per lower tier, and a bound on threads stuck in it.

A hung NFS server or an S3 brownout does not fail fast: calls block for their timeouts.
Each lower tier therefore has a ``Breaker``:

* **up**: every call is allowed. ``failures`` consecutive failed calls (an error, or a
  call slower than its allowance), or one call in flight for longer than its allowance
  (a hung call never returns to report itself), mark the tier **down**. A call's
  allowance is ``slow_s`` plus the bytes it moves at ``min_bytes_per_s``: a healthy 84 MB
  chunk is not a fault because it takes longer than a 1 MB one.
* **down**: lookups skip the tier, reads and probes are refused, writes are dropped and
  counted. After ``cooldown_s`` the next caller gets a trial call (**half-open**):
  its success brings the tier back up, its failure starts another cooldown.
* Reads and probes (the latency path) are bounded: once ``max_in_flight`` of them have
  been running longer than ``stuck_s`` (a fifth of ``slow_s``) plus their bytes'
  allowance, more are refused as if
  the tier were down (without changing its state), so a hanging tier holds at most that
  many threads on the read path. Healthy reads take milliseconds and are never counted:
  a busy tier is not a failing one. Writes are not refused while the tier is up; a write
  that hangs trips the breaker after ``slow_s``, and from then on writes are dropped.

Every transition is logged once and exported as ``kvtier_tier_up{tier}`` (1 up, 0 not),
both after the lock is released.

Threads: any (IO threads call, vLLM's scheduler thread asks ``available`` and ``up``).
One lock; no I/O, logging or metrics under it. Time comes from the injected ``Clock``.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum

from kvtier.clock import SYSTEM_CLOCK, Clock
from kvtier.config import HealthConfig
from kvtier.metrics import set_tier_up

log = logging.getLogger("kvtier.health")


class TierState(StrEnum):
    UP = "up"
    DOWN = "down"
    TRIAL = "trial"  # half-open: one call is testing the tier


class TierUnavailable(Exception):
    """The tier is down, or has as many calls in flight as it may; nothing was asked."""


class Breaker:
    def __init__(
        self,
        tier: str,
        *,
        failures: int = 3,
        slow_s: float = 5.0,
        cooldown_s: float = 10.0,
        max_in_flight: int = 1,
        min_bytes_per_s: float = 20 * 2**20,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if (failures < 1 or slow_s <= 0 or cooldown_s < 0 or max_in_flight < 1
                or min_bytes_per_s <= 0):
            raise ValueError("Breaker needs failures >= 1, slow_s > 0, cooldown_s >= 0, "
                             "max_in_flight >= 1, min_bytes_per_s > 0")
        self.min_bytes_per_s = min_bytes_per_s
        self.tier = tier
        self.failures = failures
        self.slow_s = slow_s
        self.cooldown_s = cooldown_s
        self.max_in_flight = max_in_flight
        self.stuck_s = slow_s / 5
        self.clock = clock
        self.state = TierState.UP
        self._lock = threading.Lock()
        self._failed = 0
        self._down_since = 0.0
        self._calls: dict[int, tuple[float, float]] = {}  # call id -> (start, allowance)
        self._events: list[tuple[bool, str]] = []  # (up, message) to publish, unlocked
        self._read_ids: set[int] = set()
        self._ids = itertools.count()
        self._trial: int | None = None
        self.refused = 0
        set_tier_up(tier, True)

    @property
    def up(self) -> bool:
        """The tier is up (a hung call found here trips the breaker first)."""
        with self._lock:
            self._check_stuck()
            up = self.state is TierState.UP
        self._publish()
        return up

    def start_down(self, why: str) -> None:
        """Mark the tier down now (its opening did not answer at start): skipped until a
        trial after ``cooldown_s`` succeeds. Logged and exported like any trip."""
        with self._lock:
            self._go_down(why)
        self._publish()

    def overdue(self, seconds: float, *, reads: bool = False) -> bool:
        """Has a call in flight (with ``reads``: a read) been running for ``seconds``
        plus its bytes' allowance? A tier that has stopped answering shows it here long
        before any call returns (or ``slow_s`` trips the breaker); a long healthy write
        of a large chunk is not overdue. Writes are left out with ``reads``: a write's
        fsync on a busy shared filesystem takes far longer than a read. Memory only."""
        now = self.clock.monotonic()
        with self._lock:
            return any(now - t0 >= seconds + allow for cid, (t0, allow) in self._calls.items()
                       if not reads or cid in self._read_ids)

    def allowance(self, nbytes: int) -> float:
        """Seconds a healthy call moving ``nbytes`` may take beyond ``slow_s``."""
        return max(0, nbytes) / self.min_bytes_per_s

    def available(self) -> bool:
        """Would a read be allowed now? (A hung call found here trips the breaker.)"""
        with self._lock:
            self._check_stuck()
            if self.state is TierState.UP:
                ok = self._reads < self.max_in_flight
            else:
                ok = self.state is TierState.DOWN and self._cooled() and not self._calls
        self._publish()
        return ok

    @contextmanager
    def call(self, *, read: bool, nbytes: int = 0) -> Iterator[Call]:
        """Run one call to the tier that moves about ``nbytes``; raises
        ``TierUnavailable`` (asking nothing) if it may not be called now. ``Call.fail()``
        inside the block reports a call that returned an error status; an exception out
        of the block is a failure too, and so is a call slower than its allowance."""
        allowance = self.allowance(nbytes)
        try:
            cid = self._enter(read, allowance)
        finally:
            self._publish()
        t0 = self.clock.monotonic()
        c = Call()
        ok = False
        try:
            yield c
            ok = not c.failed and self.clock.monotonic() - t0 < self.slow_s + allowance
        finally:
            self._exit(cid, ok)
            self._publish()

    def _publish(self) -> None:
        """Log and export the transitions recorded under the lock (outside it)."""
        if not self._events:
            return
        with self._lock:
            events, self._events = self._events, []
        for up, message in events:
            set_tier_up(self.tier, up)
            log.warning("%s", message)

    # -- internals (under the lock) ----------------------------------------------------
    def _cooled(self) -> bool:
        return self.clock.monotonic() - self._down_since >= self.cooldown_s

    def _check_stuck(self) -> None:
        if self.state is not TierState.UP or not self._calls:
            return
        now = self.clock.monotonic()
        if any(now - t0 >= self.slow_s + allow for t0, allow in self._calls.values()):
            self._go_down("a call has been running for longer than its allowance "
                          f"({self.slow_s:g} s plus its bytes)")

    def _enter(self, read: bool, allowance: float) -> int:
        with self._lock:
            self._check_stuck()
            cid = next(self._ids)
            if self.state is TierState.UP and (not read or self._reads < self.max_in_flight):
                pass
            elif self.state is TierState.DOWN and self._cooled() and not self._calls:
                self.state = TierState.TRIAL
                self._trial = cid
            else:
                self.refused += 1
                raise TierUnavailable(f"tier {self.tier} is {self.state.value}")
            self._calls[cid] = (self.clock.monotonic(), allowance)
            if read:
                self._read_ids.add(cid)
            return cid

    @property
    def _reads(self) -> int:
        """Reads in flight for longer than ``stuck_s`` plus their bytes' allowance (under
        the lock): a long healthy read of a large chunk is not stuck."""
        now = self.clock.monotonic()
        return sum(1 for cid in self._read_ids
                   if now - self._calls[cid][0] >= self.stuck_s + self._calls[cid][1])

    def _exit(self, cid: int, ok: bool) -> None:
        with self._lock:
            self._calls.pop(cid, None)
            self._read_ids.discard(cid)
            if cid == self._trial:
                self._trial = None
                if ok:
                    self.state = TierState.UP
                    self._failed = 0
                    self._events.append((True, f"kvtier: tier {self.tier} is back up"))
                else:
                    self._go_down("the trial call failed")
                return
            if self.state is not TierState.UP:
                return  # a late answer from before the trip: the trial decides
            if ok:
                self._failed = 0
                return
            self._failed += 1
            if self._failed >= self.failures:
                self._go_down(f"{self._failed} calls in a row failed or took over "
                              f"{self.slow_s:g} s")

    def _go_down(self, why: str) -> None:
        was_up = self.state is TierState.UP
        self.state = TierState.DOWN
        self._down_since = self.clock.monotonic()
        self._failed = 0
        if was_up:
            self._events.append((False, (
                f"kvtier: tier {self.tier} is down: {why}; skipping it (reads miss, writes "
                f"are dropped) and trying again in {self.cooldown_s:.0f} s")))


def breakers_for(
    tiers: list[str], cfg: HealthConfig, io_threads: int, clock: Clock = SYSTEM_CLOCK
) -> list[Breaker]:
    """One breaker per lower tier, as ``health`` configures them; stuck reads in one tier
    are bounded to ``io_threads - 1`` so a hung tier leaves a thread for the others."""
    return [
        Breaker(name, failures=cfg.failures, slow_s=cfg.slow_seconds,
                cooldown_s=cfg.cooldown_seconds, max_in_flight=max(1, io_threads - 1),
                min_bytes_per_s=cfg.min_mib_per_second * 2**20, clock=clock)
        for name in tiers
    ]


class Call:
    """One call in progress; ``fail()`` marks it failed."""

    def __init__(self) -> None:
        self.failed = False

    def fail(self) -> None:
        self.failed = True
