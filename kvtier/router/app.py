"""The router's aiohttp application: P/D hand-off, streaming pass-through, leases, metrics.

Invariants:

* Per-request state lives in locals and one ``Turn`` record per request; the only shared
  mutable state is the ``ConversationMap``, the backend pools' health marks and the metrics.
  Concurrent requests of different conversations therefore never see each other's params.
* A prefill call always has ``stream=False``, ``max_tokens=1`` and
  ``kv_transfer_params={"kvtier": {"phase": "prefill"}}``; a decode call carries the
  prefill's ``namespace``/``tokens``/``last_key`` as ``expect`` (or no ``expect`` if the
  prefill server returned none). ``kv_transfer_params`` from clients are refused.
* Streamed decode bytes are forwarded unchanged, chunk by chunk, as they arrive.
* Nothing waits without a bound: every backend call has a connect timeout and a request
  timeout (whole call, or gap between streamed chunks), health probes have their own.
  Errors map to: refused/unreachable 502, backend 5xx 502 (with its message), timeout 504,
  no usable backend 503; a backend 4xx is passed through unchanged.
* Behaviour over time (conversation TTL, backend cooldown) uses the injected ``Clock``;
  the latencies reported in logs and metrics are measured with ``time.perf_counter``.
* Blocking lease renewal runs in a worker thread (``asyncio.to_thread``), never on the loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import aiohttp
from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from kvtier.clock import SYSTEM_CLOCK, Clock
from kvtier.router import RouterSettings
from kvtier.router.conversations import ConversationMap
from kvtier.tiers.base import TierError

log = logging.getLogger(__name__)

Endpoint = Literal["completions", "chat"]
Role = Literal["prefill", "decode"]
ChainRenewer = Callable[[str], int]  # last_key_hex -> chunks renewed; blocking

CONVERSATION_HEADER = "X-Conversation-Id"
STATE_HEADER = "X-KVTier-Conversation"
PATHS: Mapping[Endpoint, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
REQUIRED: Mapping[Endpoint, str] = {"completions": "prompt", "chat": "messages"}
MAX_CONVERSATION_ID = 256
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RouterError(Exception):
    """An error the router answers itself, as an OpenAI-style JSON error."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind

    def response(self) -> web.Response:
        body = {"error": {"message": self.message, "type": self.kind, "code": self.status}}
        return web.json_response(body, status=self.status)


class BackendRejected(Exception):
    """A backend answered 4xx: its status and body go back to the client unchanged."""

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"backend answered {status}")
        self.status, self.body, self.content_type = status, body, content_type

    def response(self) -> web.Response:
        return web.Response(status=self.status, body=self.body, content_type=self.content_type)


# -- request parsing ---------------------------------------------------------------------


@dataclass(frozen=True)
class ProxyRequest:
    endpoint: Endpoint
    body: dict[str, Any]  # as the client sent it, minus ``conversation_id``; never mutated
    stream: bool
    conversation_id: str | None


def _bad(message: str) -> RouterError:
    return RouterError(400, message)


def _check_conversation_id(value: object, source: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _bad(f"{source} must be a non-empty string, got {value!r}")
    if len(value) > MAX_CONVERSATION_ID:
        raise _bad(f"{source} must be at most {MAX_CONVERSATION_ID} characters")
    return value


def _check_token_limit(body: Mapping[str, Any], name: str) -> None:
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _bad(f"'{name}' must be a positive integer, got {value!r}")


def parse_request(endpoint: Endpoint, raw: bytes, header_id: str | None) -> ProxyRequest:
    """Validate a client body; raises ``RouterError(400)`` naming the offending field."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise _bad(f"request body is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise _bad(f"request body must be a JSON object, got {type(doc).__name__}")
    body: dict[str, Any] = dict(doc)
    if REQUIRED[endpoint] not in body:
        raise _bad(f"'{REQUIRED[endpoint]}' is required for {PATHS[endpoint]}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad(f"'stream' must be true or false, got {stream!r}")
    _check_token_limit(body, "max_tokens")
    _check_token_limit(body, "max_completion_tokens")
    if "kv_transfer_params" in body:
        raise _bad("'kv_transfer_params' is set by the router; remove it from the request")
    cid: str | None = None
    if "conversation_id" in body:
        cid = _check_conversation_id(body.pop("conversation_id"), "'conversation_id'")
    elif header_id is not None:
        cid = _check_conversation_id(header_id, f"header {CONVERSATION_HEADER}")
    return ProxyRequest(endpoint, body, stream, cid)


def prefill_body(req: ProxyRequest, *, reuse: bool = True) -> dict[str, Any]:
    body = dict(req.body)
    body["stream"] = False
    body.pop("stream_options", None)
    body.pop("min_tokens", None)  # would exceed max_tokens=1 and be refused
    body["max_tokens"] = 1
    if req.endpoint == "chat" and "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    kvtier: dict[str, Any] = {"phase": "prefill"}
    if not reuse:
        kvtier["load"] = False
    body["kv_transfer_params"] = {"kvtier": kvtier}
    return body


def decode_body(req: ProxyRequest, handoff: Mapping[str, Any] | None) -> dict[str, Any]:
    kvtier: dict[str, Any] = {"phase": "decode"}
    if handoff is not None:
        kvtier["expect"] = {k: handoff.get(k) for k in ("namespace", "tokens", "last_key")}
    return {**req.body, "kv_transfer_params": {"kvtier": kvtier}}


def _prefill_headers(turn: Turn) -> dict[str, str]:
    """What the prefill phase did, for clients and benchmarks (known before decode)."""
    return {
        "X-KVTier-Prefill-Ms": f"{(turn.prefill_s or 0.0) * 1e3:.1f}",
        "X-KVTier-Restored-Tokens": str(turn.restored_tokens),
        "X-KVTier-Restore-Ms": f"{turn.restore_ms:.1f}",
    }


def kvtier_params(doc: object) -> dict[str, Any] | None:
    """``doc["kv_transfer_params"]["kvtier"]`` if it is there and a dict."""
    ktp = doc.get("kv_transfer_params") if isinstance(doc, dict) else None
    params = ktp.get("kvtier") if isinstance(ktp, dict) else None
    return params if isinstance(params, dict) else None


def _number(params: Mapping[str, Any] | None, name: str) -> float:
    value = params.get(name) if params is not None else None
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


# -- backends ------------------------------------------------------------------------------


def stable_hash(text: str) -> int:
    """The same on every router process (unlike ``hash``), so stickiness survives restarts."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class BackendPool:
    """The servers of one role. Picks round-robin, or by conversation hash (sticky); a
    server that refused a connection is skipped for ``cooldown`` seconds."""

    def __init__(self, role: Role, urls: tuple[str, ...], cooldown: float, clock: Clock) -> None:
        self.role = role
        self.urls = tuple(u.rstrip("/") for u in urls)
        self._cooldown, self._clock = cooldown, clock
        self._next = itertools.count()
        self._down_until: dict[str, float] = {}

    def candidates(self, conversation_id: str | None) -> list[str]:
        """Healthy servers in the order to try them; ``RouterError(503)`` if there are none."""
        if not self.urls:
            raise RouterError(503, f"no {self.role} backend configured", "service_unavailable")
        n = len(self.urls)
        start = stable_hash(conversation_id) % n if conversation_id else next(self._next) % n
        now = self._clock.monotonic()
        order = self.urls[start:] + self.urls[:start]
        healthy = [u for u in order if self._down_until.get(u, 0.0) <= now]
        if not healthy:
            raise RouterError(503, f"no healthy {self.role} backend (all refused connections "
                              f"in the last {self._cooldown:g}s: {', '.join(self.urls)})",
                              "service_unavailable")
        return healthy

    def mark_down(self, url: str) -> None:
        self._down_until[url] = self._clock.monotonic() + self._cooldown

    def mark_up(self, url: str) -> None:
        self._down_until.pop(url, None)


def _backend_message(body: bytes) -> str:
    try:
        doc = json.loads(body)
    except ValueError:
        return body.decode(errors="replace")[:500]
    err = doc.get("error") if isinstance(doc, dict) else None
    if isinstance(err, dict) and "message" in err:
        return str(err["message"])[:500]
    if isinstance(doc, dict) and "message" in doc:
        return str(doc["message"])[:500]
    return body.decode(errors="replace")[:500]


def check_status(role: Role, url: str, status: int, body: bytes, content_type: str) -> None:
    """Raise for a non-2xx backend answer: 4xx passes through, anything else is a 502."""
    if 200 <= status < 300:
        return
    if 400 <= status < 500:
        raise BackendRejected(status, body, content_type)
    raise RouterError(502, f"{role} backend {url} answered {status}: {_backend_message(body)}",
                      "backend_error")


@dataclass
class Turn:
    """What one request measured; filled in as it goes, logged once at the end."""

    endpoint: Endpoint
    started: float
    conversation: str | None = None
    prefill_s: float | None = None
    restored_tokens: int = 0
    restore_ms: float = 0.0
    ttft_s: float | None = None
    status: int = 0
    stream_broken: bool = False


class RouterMetrics:
    """Prometheus metrics in a registry the router owns (several routers per process, as in
    tests, never share counts; the process-global registry is left alone)."""

    def __init__(self, conversations: Callable[[], int]) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvtier_router_requests_total", "Requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prefill = Histogram("kvtier_router_prefill_seconds", "Wall time of the prefill call",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("kvtier_router_ttft_seconds", "Request arrival to first decode byte",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.kv_load = Histogram("kvtier_router_kv_load_seconds",
                                 "KV restore time the prefill server reported",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.kv_tokens = Counter("kvtier_router_kv_load_tokens_total",
                                 "Tokens whose KV prefill restored instead of computing",
                                 registry=r)
        self.renewed = Counter("kvtier_router_renewed_chunks_total", "Chunk leases renewed",
                               registry=r)
        gauge = Gauge("kvtier_router_conversations", "Tracked (unexpired) conversations",
                      registry=r)
        gauge.set_function(lambda: float(conversations()))

    def observe(self, turn: Turn) -> None:
        self.requests.labels(turn.endpoint, str(turn.status or "aborted")).inc()
        if turn.prefill_s is not None:
            self.prefill.observe(turn.prefill_s)
        if turn.restored_tokens > 0:  # a load happened; turns without one would skew it to 0
            self.kv_load.observe(turn.restore_ms / 1e3)
            self.kv_tokens.inc(turn.restored_tokens)
        if turn.ttft_s is not None:
            self.ttft.observe(turn.ttft_s)

    def render(self) -> web.Response:
        return web.Response(body=generate_latest(self.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})


class Router:
    """The request handlers and the state they share (see the module invariants)."""

    def __init__(self, settings: RouterSettings, clock: Clock, renewer: ChainRenewer | None):
        self.settings = settings
        self.conversations = ConversationMap(settings.ttl_seconds, clock.monotonic)
        cooldown = settings.backend_cooldown
        self.pools: dict[Role, BackendPool] = {
            "prefill": BackendPool("prefill", settings.prefill, cooldown, clock),
            "decode": BackendPool("decode", settings.decode, cooldown, clock),
        }
        self.metrics = RouterMetrics(lambda: len(self.conversations))
        self.renewer = renewer
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("router used outside its application's lifetime")
        return self._session

    async def client_session(self, _app: web.Application) -> AsyncIterator[None]:
        connector = aiohttp.TCPConnector(limit=0)  # vLLM queues requests itself
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

    async def _open(self, role: Role, req: ProxyRequest, body: dict[str, Any],
                    stream: bool) -> tuple[str, aiohttp.ClientResponse]:
        """POST to the first server of ``role`` that accepts a connection."""
        pool, refused = self.pools[role], []
        for url in pool.candidates(req.conversation_id):
            try:
                resp = await self.session.post(url + PATHS[req.endpoint], json=body,
                                               timeout=self._timeout(stream))
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
        return RouterError(504, f"{role} backend {url} did not answer within "
                           f"{self.settings.request_timeout:g}s", "timeout")

    async def _call_json(self, role: Role, req: ProxyRequest,
                         body: dict[str, Any]) -> tuple[bytes, str, object]:
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
        turn.restored_tokens = int(_number(handoff, "restored_tokens"))
        turn.restore_ms = _number(handoff, "restore_ms")
        return handoff

    async def decode(self, request: web.Request, req: ProxyRequest,
                     handoff: dict[str, Any] | None, turn: Turn) -> web.StreamResponse:
        headers = self._state_headers(req.conversation_id) | _prefill_headers(turn)
        body = decode_body(req, handoff)
        if req.stream:
            return await self._decode_stream(request, req, body, handoff, headers, turn)
        data, content_type, doc = await self._call_json("decode", req, body)
        turn.ttft_s = time.perf_counter() - turn.started
        self._remember(req.conversation_id, kvtier_params(doc) or handoff)
        return web.Response(body=data, content_type=content_type, headers=headers)

    async def _decode_stream(self, request: web.Request, req: ProxyRequest,
                             body: dict[str, Any], handoff: dict[str, Any] | None,
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
            req = parse_request(endpoint, await _read_body(request),
                                request.headers.get(CONVERSATION_HEADER))
            turn.conversation = req.conversation_id
            handoff = await self.prefill(req, turn)
            return await self.decode(request, req, handoff, turn)
        except (RouterError, BackendRejected) as e:
            return e.response()

    def _finish(self, turn: Turn) -> None:
        self.metrics.observe(turn)
        log.info("conversation=%s endpoint=%s prefill_ms=%s restored_tokens=%d restore_ms=%.1f "
                 "ttft_ms=%s status=%s%s", turn.conversation or "-", turn.endpoint,
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
            cid = _parse_renew(await _read_body(request))
            state = self.conversations.get(cid)
            if state is None:
                raise RouterError(404, f"conversation {cid!r} is unknown or expired",
                                  "not_found_error")
            renewed = await self._renew_chain(cid, state.last_key)
        except RouterError as e:
            return e.response()
        self.conversations.touch(cid)
        return web.json_response({"renewed_chunks": renewed})

    async def _renew_chain(self, cid: str, last_key: str | None) -> int:
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
        """One heartbeat: renew the chain of every live conversation; returns chunks renewed.
        A failure is logged and the next conversation is tried (the heartbeat must go on)."""
        total = 0
        for cid, state in self.conversations.live():
            try:
                total += await self._renew_chain(cid, state.last_key)
            except RouterError as e:
                log.warning("lease heartbeat: %s", e.message)
                if e.status == 501:
                    break
        return total

    async def heartbeat(self, _app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(self._beat()) if self.renewer is not None else None
        yield
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval)
            try:
                log.debug("lease heartbeat renewed %d chunks", await self.renew_all())
            except Exception:  # the heartbeat must outlive any one failure
                log.exception("lease heartbeat failed; retrying next period")


ROUTER_KEY = web.AppKey("kvtier_router", Router)


def _parse_renew(raw: bytes) -> str:
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise _bad(f"request body is not valid JSON: {e}") from None
    if not isinstance(doc, dict) or "conversation_id" not in doc:
        raise _bad('body must be {"conversation_id": "..."}')
    return _check_conversation_id(doc["conversation_id"], "'conversation_id'")


class TierRenewer:
    """Renews lease chains on the shared tiers of a kvtier config (blocking; call it from a
    worker thread). ``kvtier.lease`` is imported on first use."""

    def __init__(self, config: Path, clock: Clock) -> None:
        from kvtier.build import build_lower_tiers
        from kvtier.config import load_config

        self.tiers = [lt.tier for lt in build_lower_tiers(load_config(config), clock)]

    def __call__(self, last_key_hex: str) -> int:
        from kvtier.lease import renew_chain

        renewed: int = renew_chain(self.tiers, last_key_hex)
        return renewed

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()


def build_app(settings: RouterSettings, *, clock: Clock = SYSTEM_CLOCK,
              renewer: ChainRenewer | None = None) -> web.Application:
    """The router as an aiohttp application. ``renewer`` replaces the lease renewal that
    ``settings.tiers`` would set up (tests pass a fake); with neither, renewal is off."""
    owned: TierRenewer | None = None
    if renewer is None and settings.tiers is not None:
        renewer = owned = TierRenewer(settings.tiers, clock)
    router = Router(settings, clock, renewer)
    app = web.Application(client_max_size=settings.max_body_bytes)
    app[ROUTER_KEY] = router
    app.cleanup_ctx.extend([router.client_session, router.heartbeat])
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


async def _read_body(request: web.Request) -> bytes:
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge as e:
        raise RouterError(413, f"request body too large: {e.text}") from None
