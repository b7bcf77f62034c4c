"""Who may call the router, and how many requests it serves at once: two aiohttp middlewares.

Invariants:

* Open routes (``OPEN_PATHS``: ``/health`` and ``/metrics``) are never authenticated nor
  limited, as vLLM leaves its own ``/health`` and ``/metrics`` open: probes and scrapers
  need no key, and neither page names a conversation.
* With an API key or a tenants file configured, every other route (the proxied
  completions, the lease renewal, and unknown paths) answers 401 unless the request
  carries ``Authorization: Bearer <key>`` with a valid key. Only SHA-256 digests are
  compared, never the raw token: the single key with ``hmac.compare_digest`` on the two
  fixed-length digests (raw texts of different lengths returned early, telling the key's
  length; issue 32), tenants' keys by one dict lookup keyed by the digest (O(1) whatever
  their number; ``kvtier.router.tenants``). Keys are never logged. An
  admitted request carries its tenant (``TENANT``; ``None`` without tenants). A refused
  request reaches no backend and no conversation state, and every refusal is the same
  answer, so a caller without the key cannot learn whether a conversation id exists.
* Authentication runs before the limit: a refused request takes no slot. A request
  without a bearer token is refused before any other work (not even a look at the
  tenants file); one with a token costs one SHA-256 and one lookup.
* At most ``limit`` requests hold a slot at once; one more is answered 503 with
  ``Retry-After`` at once, never queued. A slot is given back exactly once when its request
  ends, however it ends (answer, error, cancelled because the client went away).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from kvtier.router.protocol import AUTHORIZATION, RouterError
from kvtier.router.tenants import TenantRegistry, key_digest

OPEN_PATHS = frozenset({"/health", "/metrics"})
RETRY_AFTER_SECONDS = 1

Rejected = Callable[[str], None]  # called with the reason of each refusal, for the metrics
TENANT = web.RequestKey("kvtier_tenant", str)  # the authenticated tenant's name, if any


class Authenticator:
    """Who a bearer token belongs to: the single API key (tenant ``None``), or a tenant of
    the registry. ``identify`` answers ``(known, tenant)``; ``refresh`` lets the registry
    look for a changed file first. Event loop thread only."""

    def __init__(self, api_key: str | None, tenants: TenantRegistry | None) -> None:
        if api_key is None and tenants is None:
            raise ValueError("an Authenticator needs an API key or a tenants file")
        self._digest = None if api_key is None else key_digest(api_key)
        self.tenants = tenants

    def identify(self, token: str | None) -> tuple[bool, str | None]:
        if token is None:
            return False, None
        if self.tenants is not None:
            tenant = self.tenants.authenticate(token)
            return tenant is not None, tenant
        assert self._digest is not None
        return hmac.compare_digest(key_digest(token), self._digest), None

    def refresh(self) -> Awaitable[None] | None:
        if self.tenants is not None and self.tenants.due():
            return self.tenants.refresh()
        return None


def is_open(request: web.Request) -> bool:
    """Whether ``request`` was routed to an open page (by its matched route, not raw path)."""
    resource = request.match_info.route.resource
    return resource is not None and resource.canonical in OPEN_PATHS


def bearer_token(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, else ``None``."""
    if header is None:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def require_key(auth: Authenticator, rejected: Rejected) -> Middleware:
    """A middleware answering 401 to any request to a non-open route without a valid key;
    an admitted request gets ``request[TENANT]``."""
    refusal = RouterError(401, f"missing or wrong API key: send '{AUTHORIZATION}: Bearer "
                          "<key>' with a key the router accepts",
                          "authentication_error", {"WWW-Authenticate": "Bearer"})

    @web.middleware
    async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
        if is_open(request):
            return await handler(request)
        token = bearer_token(request.headers.get(AUTHORIZATION))
        if token is None:  # refused before any other work (no look at the tenants file)
            rejected("unauthorized")
            return refusal.response()
        pending = auth.refresh()
        if pending is not None:
            await pending
        known, tenant = auth.identify(token)
        if not known:
            rejected("unauthorized")
            return refusal.response()
        if tenant is not None:
            request[TENANT] = tenant
        return await handler(request)

    return authenticate


class ConcurrencyLimit:
    """Counts the requests being served; refuses (503, ``Retry-After``) one past ``limit``.

    Used from the event loop's thread only, so the count needs no lock."""

    def __init__(self, limit: int, rejected: Rejected) -> None:
        if limit < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {limit}")
        self.limit = limit
        self.in_flight = 0
        self._rejected = rejected

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if is_open(request):
            return await handler(request)
        if self.in_flight >= self.limit:
            self._rejected("overloaded")
            return RouterError(503, f"the router is serving {self.limit} requests, its "
                               "--max-concurrency; retry shortly", "service_unavailable",
                               {"Retry-After": str(RETRY_AFTER_SECONDS)}).response()
        self.in_flight += 1
        try:
            return await handler(request)
        finally:
            self.in_flight -= 1
