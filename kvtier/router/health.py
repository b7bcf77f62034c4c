"""The router's ``/health``: backend probes, cached, so that callers never reach the backends.

Invariants:

* One probe round (one ``GET /health`` per backend, concurrently, each bounded by
  ``timeout``) runs at most once per ``max_age`` seconds of the injected clock, however
  many callers ask: a caller gets the cached state while it is fresh, and concurrent
  callers of a stale state share the one round in flight. So a ``/health`` flood costs the
  backends at most ``backends / max_age`` probes per second.
* A probe only reports; it never changes backend choice (no cooldown is cleared: a
  backend that refused requests is skipped for its cooldown whatever its ``/health``
  says).
* The answer names backends and failure reasons only to an authenticated caller (or when
  the router has no keys at all); anyone else gets ``{"status": "ok" | "unhealthy"}``.
* Event loop thread only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import aiohttp

from kvtier.clock import Clock

DEFAULT_MAX_AGE = 1.0


@dataclass(frozen=True)
class HealthState:
    ok: bool
    backends: Mapping[str, list[str]]  # role -> urls
    failed: Mapping[str, str] = field(default_factory=dict)  # url (or "config") -> why

    def body(self, detailed: bool) -> dict[str, object]:
        doc: dict[str, object] = {"status": "ok" if self.ok else "unhealthy"}
        if detailed:
            doc.update(self.backends)
            if self.failed:
                doc["failed"] = dict(self.failed)
        return doc


async def probe(session: aiohttp.ClientSession, url: str, timeout: float) -> str | None:
    """``None`` if ``url/health`` answers 200 within ``timeout`` seconds, else why not."""
    try:
        async with session.get(url + "/health",
                               timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                return f"/health answered {resp.status}"
    except TimeoutError:
        return f"/health did not answer within {timeout:g}s"
    except aiohttp.ClientError as e:
        return f"/health failed: {e!r}"
    return None


class HealthCache:
    """The last probe round's state, refreshed at most every ``max_age`` seconds."""

    def __init__(self, backends: Mapping[str, tuple[str, ...]],
                 session: Callable[[], aiohttp.ClientSession], clock: Clock, *,
                 timeout: float, max_age: float = DEFAULT_MAX_AGE) -> None:
        self.backends = {role: list(urls) for role, urls in backends.items()}
        self._session, self._clock = session, clock
        self.timeout, self.max_age = timeout, max_age
        self.rounds = 0  # probe rounds run (each one probe per backend)
        self._state: HealthState | None = None
        self._taken = 0.0
        self._round: asyncio.Task[HealthState] | None = None

    def state(self) -> Awaitable[HealthState]:
        """The cached state if fresh, else the (shared) round that refreshes it."""
        now = self._clock.monotonic()
        if self._state is not None and now - self._taken < self.max_age:
            fresh = asyncio.get_running_loop().create_future()
            fresh.set_result(self._state)
            return fresh
        if self._round is None or self._round.done():
            self._round = asyncio.create_task(self._probe_all(now))
        return asyncio.shield(self._round)  # a caller that goes away leaves it running

    async def _probe_all(self, started: float) -> HealthState:
        self.rounds += 1
        session = self._session()
        targets = [url for urls in self.backends.values() for url in urls]
        reasons = await asyncio.gather(*(probe(session, url, self.timeout) for url in targets))
        failed = {url: why for url, why in zip(targets, reasons, strict=True) if why}
        if not all(self.backends.get(role) for role in ("prefill", "decode")):
            failed["config"] = "a prefill and a decode backend are both required"
        self._state, self._taken = HealthState(not failed, self.backends, failed), started
        return self._state
