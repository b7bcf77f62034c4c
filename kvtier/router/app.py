"""The router's aiohttp application: P/D hand-off, streaming pass-through.

The HTTP contract is in ``protocol``, backend choice and status mapping in ``backends``,
authentication and the concurrency limit in ``guard``, lease renewal and the heartbeat in
``leases``, the per-request record and Prometheus metrics in ``metrics``; this module
holds the ``Router`` that ties them together, and ``build_app``.

Invariants:

* Per-request state lives in locals and one ``Turn`` record per request; the only shared
  mutable state is the ``ConversationMap``, the backend pools' health marks and the metrics.
  Concurrent requests of different conversations therefore never see each other's params.
* Streamed decode bytes are forwarded unchanged, chunk by chunk, as they arrive.
* Nothing waits without a bound: every backend call has a connect timeout and a request
  timeout (whole call, or gap between streamed chunks), health probes have their own.
  Errors map to: refused/unreachable 502, backend 5xx 502 (with its message), timeout 504,
  no usable backend 503; a backend 4xx is passed through unchanged. A backend that refused
  a connection or timed out is skipped for ``backend_cooldown`` either way.
* A client that goes away cancels its handler at once (aiohttp handler cancellation, set on
  the application itself so that any runner serving it honours it): the backend call is
  cancelled with it and its connection closed, which makes vLLM abort the request. The
  turn is counted as aborted.
* Work is bounded: ``guard`` admits at most ``max_concurrency`` requests at once and
  answers the rest 503 at once. Each admitted request holds at most one backend connection
  at a time, so the client session's connection pool needs no limit of its own.
* With an API key, only callers that presented it reach the handlers below (``guard``), so
  the ``X-KVTier-Conversation: new|known`` header is only ever shown to a key holder.
  Without one the router trusts every caller, as before (renewal answers 404 for an
  unknown id anyway).
* A client body is parsed and serialized once (``protocol``), never once per backend.
* Behaviour over time (conversation TTL, backend cooldown, leases) uses the injected
  ``Clock``; the latencies reported in logs and metrics are measured with
  ``time.perf_counter``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Middleware

from kvtier.clock import SYSTEM_CLOCK, Clock
from kvtier.router import RouterSettings
from kvtier.router.backends import BackendPool, Role, check_status
from kvtier.router.conversations import ConversationMap
from kvtier.router.guard import ConcurrencyLimit, require_api_key
from kvtier.router.leases import ChainRenewer, Collector, LeaseKeeper, TierRenewer
from kvtier.router.metrics import RouterMetrics, Turn
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
    read_body,
)

log = logging.getLogger(__name__)


class Router:
    """The request handlers and the state they share (see the module invariants)."""

    def __init__(self, settings: RouterSettings, clock: Clock, renewer: ChainRenewer | None,
                 collector: Collector | None = None) -> None:
        self.settings = settings
        self.conversations = ConversationMap(settings.ttl_seconds, clock.monotonic)
        cooldown = settings.backend_cooldown
        self.pools: dict[Role, BackendPool] = {
            "prefill": BackendPool("prefill", settings.prefill, cooldown, clock),
            "decode": BackendPool("decode", settings.decode, cooldown, clock),
        }
        self.metrics = RouterMetrics(lambda: len(self.conversations),
                                     lambda: self.limit.in_flight)
        self.limit = ConcurrencyLimit(settings.max_concurrency, self.metrics.reject)
        self.leases = LeaseKeeper(self.conversations, self.metrics,
                                  settings.heartbeat_interval, renewer, collector)
        self._session: aiohttp.ClientSession | None = None

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

    # -- one backend call --------------------------------------------------------------

    def _timeout(self, stream: bool) -> aiohttp.ClientTimeout:
        s = self.settings
        if stream:
            return aiohttp.ClientTimeout(sock_connect=s.connect_timeout,
                                         sock_read=s.request_timeout)
        return aiohttp.ClientTimeout(total=s.request_timeout, sock_connect=s.connect_timeout)

    async def _open(self, role: Role, req: ProxyRequest, body: bytes,
                    stream: bool) -> tuple[str, aiohttp.ClientResponse]:
        """POST the encoded ``body`` to the first server of ``role`` that accepts a
        connection."""
        pool, refused = self.pools[role], []
        headers = {"Content-Type": "application/json"}
        if req.authorization is not None:
            headers[AUTHORIZATION] = req.authorization
        for url in pool.candidates(req.conversation_id):
            try:
                resp = await self.session.post(url + PATHS[req.endpoint], data=body,
                                               headers=headers, timeout=self._timeout(stream))
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
                pool.mark_down(url)
                refused.append(f"{url}: {e}")
                continue
            except TimeoutError:
                raise self._timed_out(role, url) from None
            except aiohttp.ClientError as e:
                raise RouterError(502, f"{role} backend {url} failed: {e!r}",
                                  "backend_error") from None
            return url, resp
        raise RouterError(502, f"cannot connect to a {role} backend: {'; '.join(refused)}",
                          "backend_error")

    def _timed_out(self, role: Role, url: str) -> RouterError:
        """Mark ``url`` down (a server too slow to answer is skipped like one that refuses);
        returns the 504 to raise."""
        self.pools[role].mark_down(url)
        return RouterError(504, f"{role} backend {url} did not answer within "
                           f"{self.settings.request_timeout:g}s", "timeout")

    async def _call_json(self, role: Role, req: ProxyRequest,
                         body: bytes) -> tuple[bytes, str, object]:
        """A non-streamed call: (raw body, content type, parsed JSON)."""
        url, resp = await self._open(role, req, body, stream=False)
        async with resp:
            try:
                data = await resp.read()
            except TimeoutError:
                raise self._timed_out(role, url) from None
            except aiohttp.ClientError as e:
                raise RouterError(502, f"{role} backend {url} broke off: {e!r}",
                                  "backend_error") from None
            check_status(role, url, resp.status, data, resp.content_type)
        try:
            return data, resp.content_type, json.loads(data)
        except ValueError:
            raise RouterError(502, f"{role} backend {url} answered non-JSON: {data[:200]!r}",
                              "backend_error") from None

    # -- the two phases ----------------------------------------------------------------

    async def prefill(self, req: ProxyRequest, turn: Turn) -> dict[str, Any] | None:
        t0 = time.perf_counter()
        body = prefill_body(req, reuse=self.settings.dp_reuse)
        _, _, doc = await self._call_json("prefill", req, body)
        turn.prefill_s = time.perf_counter() - t0
        handoff = kvtier_params(doc)
        turn.restored_tokens = int(param_number(handoff, "restored_tokens"))
        turn.restore_ms = param_number(handoff, "restore_ms")
        by_tier = handoff.get("restored_by_tier") if handoff is not None else None
        if isinstance(by_tier, dict):
            turn.restored_by_tier = {
                str(t): int(n) for t, n in by_tier.items() if isinstance(n, int)
            }
        return handoff

    async def decode(self, request: web.Request, req: ProxyRequest,
                     handoff: dict[str, Any] | None, turn: Turn) -> web.StreamResponse:
        headers = self._state_headers(req.conversation_id) | turn.prefill_headers()
        body = decode_body(req, handoff)
        if req.stream:
            return await self._decode_stream(request, req, body, handoff, headers, turn)
        data, content_type, doc = await self._call_json("decode", req, body)
        turn.ttft_s = time.perf_counter() - turn.started
        self._remember(req.conversation_id, kvtier_params(doc) or handoff)
        return web.Response(body=data, content_type=content_type, headers=headers)

    async def _decode_stream(self, request: web.Request, req: ProxyRequest,
                             body: bytes, handoff: dict[str, Any] | None,
                             headers: dict[str, str], turn: Turn) -> web.StreamResponse:
        url, resp = await self._open("decode", req, body, stream=True)
        async with resp:
            if resp.status != 200:
                check_status("decode", url, resp.status, await resp.read(), resp.content_type)
            headers["Content-Type"] = resp.headers.get("Content-Type", "text/event-stream")
            headers["Cache-Control"] = "no-cache"
            out = web.StreamResponse(status=200, headers=headers)
            await out.prepare(request)
            turn.stream_broken = not await self._pump(resp, out, url, turn)
        if not turn.stream_broken:
            self._remember(req.conversation_id, handoff)  # vLLM sends no params when streaming
            await out.write_eof()
        return out

    async def _pump(self, resp: aiohttp.ClientResponse, out: web.StreamResponse, url: str,
                    turn: Turn) -> bool:
        """Forward the backend's bytes as they come; False if either side broke off."""
        try:
            async for chunk in resp.content.iter_any():
                if turn.ttft_s is None:
                    turn.ttft_s = time.perf_counter() - turn.started
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

    def _state_headers(self, conversation_id: str | None) -> dict[str, str]:
        if conversation_id is None:
            return {}
        known = self.conversations.get(conversation_id) is not None
        return {STATE_HEADER: "known" if known else "new"}

    def _remember(self, conversation_id: str | None, params: dict[str, Any] | None) -> None:
        if conversation_id is not None:
            self.conversations.record(conversation_id, params or {})

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

    async def _serve(self, request: web.Request, endpoint: Endpoint,
                     turn: Turn) -> web.StreamResponse:
        try:
            req = parse_request(endpoint, await read_body(request), request.headers)
            turn.conversation = req.conversation_id
            handoff = await self.prefill(req, turn)
            return await self.decode(request, req, handoff, turn)
        except (RouterError, BackendRejected) as e:
            return e.response()

    def _finish(self, turn: Turn) -> None:
        self.metrics.observe(turn)
        log.info("conversation=%s endpoint=%s prefill_ms=%s restored_tokens=%d restore_ms=%.1f "
                 "ttft_ms=%s status=%s%s", _quoted(turn.conversation), turn.endpoint,
                 _ms(turn.prefill_s), turn.restored_tokens, turn.restore_ms, _ms(turn.ttft_s),
                 turn.status or "aborted", " stream_broken" if turn.stream_broken else "")

    async def health(self, _request: web.Request) -> web.Response:
        urls = {role: list(pool.urls) for role, pool in self.pools.items()}
        targets = [(pool, url) for pool in self.pools.values() for url in pool.urls]
        reasons = await asyncio.gather(*(self._probe(pool, url) for pool, url in targets))
        failed = {url: why for (_, url), why in zip(targets, reasons, strict=True) if why}
        if not self.pools["prefill"].urls or not self.pools["decode"].urls:
            failed["config"] = "a prefill and a decode backend are both required"
        if failed:
            return web.json_response({"status": "unhealthy", **urls, "failed": failed},
                                     status=503)
        return web.json_response({"status": "ok", **urls})

    async def _probe(self, pool: BackendPool, url: str) -> str | None:
        """``None`` if ``url/health`` answers 200 in time, else why not."""
        timeout = aiohttp.ClientTimeout(total=self.settings.health_timeout)
        try:
            async with self.session.get(url + "/health", timeout=timeout) as resp:
                if resp.status != 200:
                    return f"/health answered {resp.status}"
        except TimeoutError:
            return f"/health did not answer within {self.settings.health_timeout:g}s"
        except aiohttp.ClientError as e:
            return f"/health failed: {e!r}"
        pool.mark_up(url)
        return None

    async def metrics_page(self, _request: web.Request) -> web.Response:
        return self.metrics.render()

    # -- leases ------------------------------------------------------------------------

    async def renew(self, request: web.Request) -> web.Response:
        """``POST /v1/kvtier/renew {"conversation_id": ...}``: renew that chain's leases now
        and restart its TTL."""
        try:
            cid = parse_renew(await read_body(request))
            state = self.conversations.get(cid)
            if state is None:
                raise RouterError(404, f"conversation {cid!r} is unknown or expired",
                                  "not_found_error")
            renewed = await self.leases.renew_chain(cid, state.last_key)
        except RouterError as e:
            return e.response()
        self.conversations.touch(cid)
        return web.json_response({"renewed_chunks": renewed})


ROUTER_KEY = web.AppKey("kvtier_router", Router)


def build_app(settings: RouterSettings, *, clock: Clock = SYSTEM_CLOCK,
              renewer: ChainRenewer | None = None,
              collector: Collector | None = None) -> web.Application:
    """The router as an aiohttp application. ``renewer`` and ``collector`` replace the lease
    renewal and collection that ``settings.tiers`` would set up (tests pass fakes); without
    either, that part is off. ``settings.collect=False`` turns the tiers' collector off."""
    owned: TierRenewer | None = None
    if renewer is None and settings.tiers is not None:
        renewer = owned = TierRenewer(settings.tiers, clock)
        if collector is None and settings.collect:
            collector = functools.partial(owned.expire, settings.lease_seconds)
    router = Router(settings, clock, renewer, collector)
    guards: list[Middleware] = [router.limit.middleware]  # authentication goes first
    if settings.api_key is not None:
        guards.insert(0, require_api_key(settings.api_key, router.metrics.reject))
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=guards,
                          handler_args={"handler_cancellation": True})  # see the module
    app[ROUTER_KEY] = router
    app.cleanup_ctx.extend([router.client_session, router.leases.heartbeat])
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
