"""The router's aiohttp application: the per-turn path, P/D hand-off, streaming pass-through.

The HTTP contract is in ``protocol``, backend choice and status mapping in ``backends``,
the backend calls (failover, timeouts, JSON, ``/tokenize``) in ``upstream``,
authentication and the concurrency limit in ``guard``, tenants in ``tenants``, the path
decision in ``selective``, lease renewal and the heartbeat in ``leases``, ``/health`` in
``health``, the per-request record and Prometheus metrics in ``metrics``; this module
holds the ``Router`` that ties them together, and ``build_app``; ``planner`` holds the
per-turn path state (estimate, costs, queued tokens).

Invariants:

* Per-request state lives in locals and one ``Turn`` record per request; the only shared
  mutable state is the ``ConversationMap``, the backend pools' health marks, the measured
  path costs, the in-flight token counts and the metrics, all on the loop's thread.
  Concurrent requests of different conversations therefore never see each other's params.
* Each turn takes one path (``selective.decide``): prefill-then-decode (a prefill call,
  then a decode call with its ``expect``) or decode-only (one decode call without
  ``expect``: the decode node restores what the tier holds and computes the rest).
* Streamed decode bytes are forwarded unchanged, chunk by chunk, as they arrive.
* Nothing waits without a bound: the client body has ``body_timeout``, every backend call
  a connect timeout and a request timeout (whole call, or gap between streamed chunks),
  health probes their own. Errors map to: refused/unreachable 502, backend 5xx 502 (with
  its message), timeout 504, no usable backend 503; a backend 4xx is passed through
  unchanged. A backend that refused a connection or timed out is skipped for
  ``backend_cooldown`` either way.
* A client that goes away cancels its handler at once (aiohttp handler cancellation, set on
  the application itself so that any runner serving it honours it): the backend call is
  cancelled with it and its connection closed, which makes vLLM abort the request. The
  turn is counted as aborted.
* Work is bounded: ``guard`` admits at most ``max_concurrency`` requests at once and
  answers the rest 503 at once. Each admitted request holds at most one backend connection
  at a time, and ``/health`` probes at most once per ``health_interval``, so the client
  session's connection pool needs no limit of its own.
* With keys (``--api-key`` or ``--tenants``), only callers that presented one reach the
  handlers below (``guard``). With tenants, conversations are tracked per tenant (another
  tenant's id is an unknown id), every request carries its tenant's ``cache_salt``, the
  tenant's key is never forwarded, and prefix-hit information (the ``X-KVTier-Restore*``
  headers, ``kv_transfer_params`` in non-streamed bodies) is returned only to a request
  that asks for it with ``X-KVTier-Report: hits``; by the salt it can only describe that
  tenant's own KV. Without keys the router trusts every caller, as before.
* A client body is parsed and serialized once (``protocol``), never once per backend.
* Behaviour over time (conversation TTL, backend cooldown, leases, health and tenants-file
  refresh) uses the injected ``Clock``; the latencies reported in logs and metrics, and
  the path costs learnt from them, are measured with ``time.perf_counter``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Middleware

from kvtier.clock import SYSTEM_CLOCK, Clock
from kvtier.router import RouterSettings
from kvtier.router.backends import BackendPool, Role, check_status
from kvtier.router.conversations import ConversationMap
from kvtier.router.guard import TENANT, Authenticator, ConcurrencyLimit, bearer_token, require_key
from kvtier.router.health import HealthCache
from kvtier.router.leases import ChainRenewer, Collector, LeaseKeeper, RenewLimiter
from kvtier.router.metrics import RouterMetrics, Turn
from kvtier.router.planner import Planner
from kvtier.router.prefix import (
    DEFAULT_CHUNK_TOKENS,
    DISTRUST_S,
    Held,
    HeldLookup,
    PrefixReader,
    Unkeyed,
)
from kvtier.router.protocol import (
    AUTHORIZATION,
    PATHS,
    STATE_HEADER,
    BackendRejected,
    Endpoint,
    ProxyRequest,
    RouterError,
    decode_body,
    kvtier_params,
    param_number,
    parse_renew,
    parse_request,
    prefill_body,
    prompt_usage,
    read_body,
)
from kvtier.router.storage import BoundedExecutor, RouterTiers
from kvtier.router.tenants import TenantRegistry, TenantSalts
from kvtier.router.upstream import Upstream

log = logging.getLogger(__name__)

PATH_HEADER = "X-KVTier-Path"
REPORT_HEADER = "X-KVTier-Report"  # "hits": return prefix-hit information (with tenants)
#: Request bodies larger than this are parsed on a worker thread, not the event loop's.
OFF_LOOP_BYTES = 1 << 20
HIT_HEADERS = ("X-KVTier-Restored-Tokens", "X-KVTier-Restore-Ms", "X-KVTier-Restored-By-Tier")


class Router:
    """The request handlers and the state they share (see the module invariants)."""

    def __init__(self, settings: RouterSettings, clock: Clock, renewer: ChainRenewer | None,
                 collector: Collector | None = None, prefix: PrefixReader | None = None,
                 lease_executor: BoundedExecutor | None = None) -> None:
        s = self.settings = settings
        #: the shared tiers the router opened itself (``build_app``), for ``/health``
        self.tiers: RouterTiers | None = None
        self.prefix = prefix or PrefixReader(DEFAULT_CHUNK_TOKENS, None,
                                             probe_timeout=s.probe_timeout)
        self.clock = clock
        self.conversations = ConversationMap(
            s.ttl_seconds, clock.monotonic, s.max_conversations,
            s.tenant_conversations if s.tenants is not None else None)
        self.pools: dict[Role, BackendPool] = {
            "prefill": BackendPool("prefill", s.prefill, s.backend_cooldown, clock),
            "decode": BackendPool("decode", s.decode, s.backend_cooldown, clock),
        }
        self.planner = Planner(s, self.conversations)
        self.metrics = RouterMetrics(lambda: len(self.conversations),
                                     lambda: self.limit.in_flight,
                                     lambda: self.conversations.evictions,
                                     lambda: float(self.planner.costs.threshold().tokens))
        self.limit = ConcurrencyLimit(s.max_concurrency, self.metrics.reject)
        self.leases = LeaseKeeper(self.conversations, self.metrics, s.heartbeat_interval,
                                  renewer, collector, clock=clock,
                                  lease_seconds=s.lease_seconds,
                                  concurrency=s.renew_concurrency,
                                  executor=lease_executor)
        self.renew_limit = RenewLimiter(s.renew_rate)
        tenants = None if s.tenants is None else TenantRegistry(
            s.tenants, clock, loaded=lambda result: self.metrics.tenant_reloads.labels(
                result).inc())
        #: tenants' salts, keyed by the router's secret (None without tenants)
        self.salts = TenantSalts(s.tenant_secret_file) if tenants is not None else None
        keyed = s.api_key is not None or tenants is not None
        self.auth = Authenticator(s.api_key, tenants) if keyed else None
        self.tenants = tenants
        # with tenants the router's own key (if any) goes to the backends, never the caller's
        self.backend_authorization = (f"Bearer {s.api_key}" if s.api_key is not None
                                      else None)
        self.health_cache = HealthCache(
            {role: pool.urls for role, pool in self.pools.items()}, lambda: self.session,
            clock, timeout=s.health_timeout, max_age=s.health_interval)
        self._session: aiohttp.ClientSession | None = None
        self.upstream = Upstream(s, self.pools, lambda: self.session)

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("router used outside its application's lifetime")
        return self._session

    async def client_session(self, _app: web.Application) -> AsyncIterator[None]:
        connector = aiohttp.TCPConnector(limit=0)  # bounded by max_concurrency (see module)
        async with aiohttp.ClientSession(connector=connector) as self._session:
            yield
        self._session = None

    async def reload_on_sighup(self, _app: web.Application) -> AsyncIterator[None]:
        """SIGHUP asks the tenants registry to reload (main thread's loop only)."""
        tenants = self.tenants
        installed = False
        if tenants is not None:
            try:
                asyncio.get_running_loop().add_signal_handler(
                    signal.SIGHUP, tenants.request_reload)
                installed = True
            except (NotImplementedError, RuntimeError, ValueError):
                log.warning("cannot install a SIGHUP handler here; the tenants file is still "
                            "reloaded when it changes")
        yield
        if installed:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)

    # -- the held prefix -----------------------------------------------------------------

    async def _held(self, req: ProxyRequest,
                    turn: Turn) -> tuple[tuple[int, ...] | None, Held | Unkeyed | None]:
        """The prompt's ids and what the shared tier holds of it (auto mode only: a forced
        path needs neither); the time it took is the router's own cost of the turn."""
        if self.settings.pd_mode != "auto":
            return None, None
        t0 = time.perf_counter()
        ids = await self.upstream.token_ids(req, turn)
        if isinstance(ids, str):
            held: Held | Unkeyed = ids
        else:
            held = await self.prefix.held(req.identity, ids, self.clock.monotonic())
        turn.lookup_s = time.perf_counter() - t0
        if isinstance(held, Held):
            turn.probe_heads = held.heads
        return None if isinstance(ids, str) else ids, held

    # -- the path of a turn --------------------------------------------------------------

    async def prefill(self, req: ProxyRequest, turn: Turn) -> dict[str, Any] | None:
        t0 = time.perf_counter()
        body = prefill_body(req, reuse=self.settings.dp_reuse)
        with self.planner.queue(turn):
            _, _, doc = await self.upstream.call_json("prefill", req, body)
        turn.prefill_s = time.perf_counter() - t0
        handoff = kvtier_params(doc)
        turn.prefill_tokens = int(param_number(handoff, "tokens")) or None
        turn.prefill_usage = prompt_usage(doc)
        turn.restored_tokens = int(param_number(handoff, "restored_tokens"))
        turn.restore_ms = param_number(handoff, "restore_ms")
        by_tier = handoff.get("restored_by_tier") if handoff is not None else None
        if isinstance(by_tier, dict):
            turn.restored_by_tier = {
                str(t): int(n) for t, n in by_tier.items() if isinstance(n, int)
            }
        return handoff

    async def decode(self, request: web.Request, req: ProxyRequest, key: str | None,
                     handoff: dict[str, Any] | None, turn: Turn,
                     show_hits: bool) -> web.StreamResponse:
        """The decode call of either path (``handoff`` None: decode-only, or a prefill
        that returned no params)."""
        headers = self._state_headers(key) | {PATH_HEADER: turn.path or "prefill_decode"}
        if turn.path == "prefill_decode":
            headers |= turn.prefill_headers()
        if not show_hits:
            for name in HIT_HEADERS:
                headers.pop(name, None)
        body = decode_body(req, handoff)
        if req.stream:
            return await self._decode_stream(request, req, key, body, handoff, headers, turn)
        data, content_type, doc = await self.upstream.call_json("decode", req, body)
        turn.ttft_s = time.perf_counter() - turn.started  # the whole answer (not streamed)
        self.planner.dequeue(turn)
        if turn.path == "decode_only" and turn.held_tokens:
            self._check_pricing(req, turn, doc)
        self.planner.remember(key, req, turn, handoff, doc)
        if not show_hits and isinstance(doc, dict) and "kv_transfer_params" in doc:
            doc.pop("kv_transfer_params")
            data = json.dumps(doc, ensure_ascii=False).encode()
        return web.Response(body=data, content_type=content_type, headers=headers)

    async def _decode_stream(self, request: web.Request, req: ProxyRequest, key: str | None,
                             body: bytes, handoff: dict[str, Any] | None,
                             headers: dict[str, str], turn: Turn) -> web.StreamResponse:
        url, resp = await self.upstream.open("decode", req, body, stream=True)
        async with resp:
            if resp.status != 200:
                check_status("decode", url, resp.status, await resp.read(), resp.content_type)
            headers["Content-Type"] = resp.headers.get("Content-Type", "text/event-stream")
            headers["Cache-Control"] = "no-cache"
            out = web.StreamResponse(status=200, headers=headers)
            await out.prepare(request)
            turn.stream_broken = not await self._pump(resp, out, url, turn)
        if not turn.stream_broken:
            self.planner.remember(key, req, turn, handoff, None)  # no params when streaming
            await out.write_eof()
        return out

    async def _pump(self, resp: aiohttp.ClientResponse, out: web.StreamResponse, url: str,
                    turn: Turn) -> bool:
        """Forward the backend's bytes as they come; False if either side broke off."""
        try:
            async for chunk in resp.content.iter_any():
                if turn.ttft_s is None:
                    turn.ttft_s = time.perf_counter() - turn.started
                    turn.streamed = True
                    self.planner.dequeue(turn)  # its prompt is computed: no longer queued
                await out.write(chunk)
        except ConnectionResetError:
            log.warning("client went away while streaming from %s", url)
            return False
        except (aiohttp.ClientError, TimeoutError) as e:
            log.warning("decode stream from %s broke off: %r", url, e)
            if isinstance(e, TimeoutError):  # silent for request_timeout: skip it a while
                self.pools["decode"].mark_down(url)
            event = {"error": {"message": f"decode backend stream broke off: {e!r}",
                               "type": "backend_error", "code": 502}}
            try:
                await out.write(f"data: {json.dumps(event)}\n\n".encode())
                await out.write_eof()
            except ConnectionResetError:
                pass
            return False
        return True

    def _check_pricing(self, req: ProxyRequest, turn: Turn, doc: object) -> None:
        """A decode-only answer says what its node served without computing (vLLM's
        ``cached_tokens``, its own prefix cache and kvtier's loads; only where the server
        runs with ``--enable-prompt-tokens-details``): well short of
        what was priced as held (chunks collected since the router's index saw them), the
        identity's next lookups check every chunk (``PrefixReader.shortfall``)."""
        params = kvtier_params(doc)
        usage = prompt_usage(doc)
        if params is None or "restored_tokens" not in params or usage is None \
                or usage.cached_tokens is None:
            # not a kvtier engine's answer, or one without vLLM's cached_tokens
            # (--enable-prompt-tokens-details): kvtier's restored_tokens leaves out what
            # vLLM's own prefix cache served, so a healthy return would look short
            return
        served = max(int(param_number(params, "restored_tokens")), usage.cached_tokens)
        assert turn.held_tokens is not None
        if self.prefix.shortfall(req.identity, turn.held_tokens, served,
                                 self.clock.monotonic()):
            self.metrics.shortfalls.inc()
            log.info("decode node restored %d of the %d tokens priced as held; checking "
                     "this identity's chains chunk by chunk for %.0f s", served,
                     turn.held_tokens, DISTRUST_S)

    def _state_headers(self, key: str | None) -> dict[str, str]:
        if key is None:
            return {}
        known = self.conversations.get(key) is not None
        return {STATE_HEADER: "known" if known else "new"}

    # -- handlers ----------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, "completions")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, "chat")

    async def _proxy(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        turn = Turn(endpoint, time.perf_counter())
        try:
            resp = await self._serve(request, endpoint, turn)
            turn.status = resp.status
            return resp
        finally:
            self._finish(turn)  # also when the client went away (status 0: aborted)

    def _salt(self, tenant: str | None) -> str | None:
        """The salt the router sets for ``tenant``'s requests (None: the client's own)."""
        if tenant is None or self.salts is None:
            return None
        return self.salts.salt_of(tenant)

    def _conversation_key(self, tenant: str | None, cid: str | None) -> str | None:
        """The map key of a conversation: per tenant (ids are printable, so NUL cannot be
        part of one)."""
        if cid is None or tenant is None:
            return cid
        return f"{tenant}\x00{cid}"

    async def _serve(self, request: web.Request, endpoint: Endpoint,
                     turn: Turn) -> web.StreamResponse:
        try:
            tenant = request.get(TENANT)
            turn.tenant = tenant
            raw = await read_body(request, self.settings.body_timeout)
            parse = functools.partial(parse_request, endpoint, raw, request.headers,
                                      salt=self._salt(tenant),
                                      max_prompt_tokens=self.settings.max_prompt_tokens)
            # a large body is parsed (and its ids checked) off the event loop's thread
            req = await asyncio.to_thread(parse) if len(raw) > OFF_LOOP_BYTES else parse()
            if self.tenants is not None:
                req = replace(req, authorization=self.backend_authorization)
            key = self._conversation_key(tenant, req.conversation_id)
            turn.conversation = req.conversation_id
            state = self.conversations.get(key) if key is not None else None
            ids, held = await self._held(req, turn)
            decision = self.planner.plan(req, state, held, turn)
            show_hits = (self.tenants is None
                         or request.headers.get(REPORT_HEADER, "").strip().lower() == "hits")
            if decision.path == "decode_only":
                return await self._decode_only(request, req, key, turn, show_hits)
            handoff = await self.prefill(req, turn)
            if ids is not None:  # the digest of this identity, checked against these ids
                self.prefix.book.learn(req.identity, ids, handoff)
            return await self.decode(request, req, key, handoff, turn, show_hits)
        except (RouterError, BackendRejected) as e:
            return e.response()

    async def _decode_only(self, request: web.Request, req: ProxyRequest, key: str | None,
                           turn: Turn, show_hits: bool) -> web.StreamResponse:
        with self.planner.queue(turn):
            return await self.decode(request, req, key, None, turn, show_hits)

    def _finish(self, turn: Turn) -> None:
        self.metrics.observe(turn)
        self.planner.learn(turn)
        log.info("conversation=%s endpoint=%s path=%s reason=%s uncached=%s held=%s "
                 "lookup_ms=%s tokenize_ms=%s prefill_ms=%s restored_tokens=%d restore_ms=%.1f "
                 "ttft_ms=%s "
                 "status=%s%s",
                 _quoted(turn.conversation), turn.endpoint, turn.path or "-",
                 turn.reason or "-", "-" if turn.uncached_tokens is None
                 else turn.uncached_tokens, "-" if turn.held_tokens is None
                 else turn.held_tokens, _ms(turn.lookup_s), _ms(turn.tokenize_s),
                 _ms(turn.prefill_s),
                 turn.restored_tokens,
                 turn.restore_ms, _ms(turn.ttft_s), turn.status or "aborted",
                 " stream_broken" if turn.stream_broken else "")

    async def health(self, request: web.Request) -> web.Response:
        """From the cached probe state (``health``); details only to a key holder."""
        state = await self.health_cache.state()
        detailed = self.auth is None
        if self.auth is not None:
            pending = self.auth.refresh()
            if pending is not None:
                await pending
            detailed = self.auth.identify(bearer_token(request.headers.get(AUTHORIZATION)))[0]
        body = state.body(detailed)
        if detailed and self.tiers is not None:  # a tier down is not unhealthy: P/D goes on
            body["tiers"] = self.tiers.states()
        return web.json_response(body, status=200 if state.ok else 503)

    async def metrics_page(self, _request: web.Request) -> web.Response:
        return self.metrics.render()

    # -- leases ------------------------------------------------------------------------

    async def renew(self, request: web.Request) -> web.Response:
        """``POST /v1/kvtier/renew {"conversation_id": ...}``: renew that chain's leases now
        and restart its TTL."""
        try:
            wait = self.renew_limit.take(request.get(TENANT), self.clock.monotonic())
            if wait is not None:
                raise RouterError(429, "too many renew calls: at most "
                                  f"{self.settings.renew_rate:g} a second (--renew-rate); "
                                  f"retry in {wait:.1f} s", "rate_limit_exceeded",
                                  {"Retry-After": str(max(1, math.ceil(wait)))})
            cid = parse_renew(await read_body(request, self.settings.body_timeout))
            key = self._conversation_key(request.get(TENANT), cid)
            assert key is not None
            state = self.conversations.get(key)
            if state is None:
                raise RouterError(404, f"conversation {cid!r} is unknown or expired",
                                  "not_found_error")
            renewed = await self.leases.renew_chain(cid, state.last_key)
        except RouterError as e:
            return e.response()
        self.conversations.touch(key)
        self.conversations.mark_renewed(key, self.clock.monotonic())
        return web.json_response({"renewed_chunks": renewed})


ROUTER_KEY = web.AppKey("kvtier_router", Router)


def build_app(settings: RouterSettings, *, clock: Clock = SYSTEM_CLOCK,
              renewer: ChainRenewer | None = None,
              collector: Collector | None = None) -> web.Application:
    """The router as an aiohttp application. ``renewer`` and ``collector`` replace the lease
    renewal and collection that ``settings.tiers`` would set up (tests pass fakes); without
    either, that part is off. ``settings.collect=False`` turns the tiers' collector off.
    Raises ``TenantsError`` if ``settings.tenants`` cannot be loaded."""
    owned: RouterTiers | None = None
    if renewer is None and settings.tiers is not None:
        # never waits on storage: a tier not open within OPEN_BOUND_S joins when it answers
        owned = RouterTiers(settings.tiers, clock, lease_threads=settings.renew_concurrency + 1)
        renewer = owned.renew_chain
        if collector is None and settings.collect:
            collector = functools.partial(owned.expire, settings.lease_seconds)
    prefix = PrefixReader(
        owned.chunk_tokens if owned is not None else DEFAULT_CHUNK_TOKENS,
        HeldLookup(owned.tiers, executor=owned.probes) if owned is not None else None,
        probe_timeout=settings.probe_timeout, max_ids=settings.max_prompt_tokens)
    router = Router(settings, clock, renewer, collector, prefix,
                    lease_executor=owned.leases if owned is not None else None)
    router.tiers = owned
    guards: list[Middleware] = [router.limit.middleware]  # authentication goes first
    if router.auth is not None:
        guards.insert(0, require_key(router.auth, router.metrics.reject))
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=guards,
                          handler_args={"handler_cancellation": True})  # see the module
    app[ROUTER_KEY] = router
    app.cleanup_ctx.extend([router.client_session, router.leases.heartbeat,
                            router.reload_on_sighup])
    if owned is not None:
        app.on_cleanup.append(lambda _app: asyncio.to_thread(owned.close))
    app.router.add_post(PATHS["completions"], router.completions)
    app.router.add_post(PATHS["chat"], router.chat)
    app.router.add_post("/v1/kvtier/renew", router.renew)
    app.router.add_get("/health", router.health)
    app.router.add_get("/metrics", router.metrics_page)
    return app


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _quoted(text: str | None) -> str:
    """Client text for a log line: quoted and escaped, so it cannot forge fields or lines."""
    return "-" if text is None else repr(text)
