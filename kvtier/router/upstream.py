"""The router's calls to its backends: a POST to the first server of a role that accepts a
connection, a non-streamed JSON call, and vLLM's ``/tokenize`` for a prompt's ids.

Invariants (those of ``kvtier.router.app`` that live here):

* Nothing waits without a bound: every call has a connect timeout and a request timeout
  (whole call, or gap between streamed chunks; ``/tokenize`` its own). Errors map to:
  refused/unreachable 502, backend 5xx 502 (with its message), timeout 504, no usable
  backend 503; a backend 4xx is passed through unchanged (``backends.check_status``).
* A backend that refused a connection or timed out is marked down in its pool, so it is
  skipped for ``backend_cooldown``.
* Runs on the router's event loop only, like the ``Router`` that owns it; holds no state
  of its own besides the pools it is given.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import aiohttp

from kvtier.router import RouterSettings
from kvtier.router.backends import BackendPool, Role, check_status
from kvtier.router.metrics import Turn
from kvtier.router.prefix import Unkeyed
from kvtier.router.protocol import (
    AUTHORIZATION,
    PATHS,
    ProxyRequest,
    RouterError,
    encode_json,
)


class Upstream:
    """Calls to the prefill and decode servers of ``pools`` over the router's client
    session (``session()``: raises outside the application's lifetime)."""

    def __init__(self, settings: RouterSettings, pools: dict[Role, BackendPool],
                 session: Callable[[], aiohttp.ClientSession]) -> None:
        self.settings = settings
        self.pools = pools
        self._session = session

    def _timeout(self, stream: bool) -> aiohttp.ClientTimeout:
        s = self.settings
        if stream:
            return aiohttp.ClientTimeout(sock_connect=s.connect_timeout,
                                         sock_read=s.request_timeout)
        return aiohttp.ClientTimeout(total=s.request_timeout, sock_connect=s.connect_timeout)

    async def open(self, role: Role, req: ProxyRequest, body: bytes,
                    stream: bool) -> tuple[str, aiohttp.ClientResponse]:
        """POST the encoded ``body`` to the first server of ``role`` that accepts a
        connection."""
        pool, refused = self.pools[role], []
        headers = {"Content-Type": "application/json"}
        if req.authorization is not None:
            headers[AUTHORIZATION] = req.authorization
        for url in pool.candidates(req.conversation_id):
            try:
                resp = await self._session().post(url + PATHS[req.endpoint], data=body,
                                               headers=headers, timeout=self._timeout(stream))
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
                pool.mark_down(url)
                refused.append(f"{url}: {e}")
                continue
            except TimeoutError:
                raise self.timed_out(role, url) from None
            except aiohttp.ClientError as e:
                raise RouterError(502, f"{role} backend {url} failed: {e!r}",
                                  "backend_error") from None
            return url, resp
        raise RouterError(502, f"cannot connect to a {role} backend: {'; '.join(refused)}",
                          "backend_error")

    def timed_out(self, role: Role, url: str) -> RouterError:
        """Mark ``url`` down (a server too slow to answer is skipped like one that refuses);
        returns the 504 to raise."""
        self.pools[role].mark_down(url)
        return RouterError(504, f"{role} backend {url} did not answer within "
                           f"{self.settings.request_timeout:g}s", "timeout")

    async def call_json(self, role: Role, req: ProxyRequest,
                         body: bytes) -> tuple[bytes, str, object]:
        """A non-streamed call: (raw body, content type, parsed JSON)."""
        url, resp = await self.open(role, req, body, stream=False)
        async with resp:
            try:
                data = await resp.read()
            except TimeoutError:
                raise self.timed_out(role, url) from None
            except aiohttp.ClientError as e:
                raise RouterError(502, f"{role} backend {url} broke off: {e!r}",
                                  "backend_error") from None
            check_status(role, url, resp.status, data, resp.content_type)
        try:
            return data, resp.content_type, json.loads(data)
        except ValueError:
            raise RouterError(502, f"{role} backend {url} answered non-JSON: {data[:200]!r}",
                              "backend_error") from None

    async def token_ids(self, req: ProxyRequest, turn: Turn) -> tuple[int, ...] | Unkeyed:
        """The prompt's ids: the client's, else from vLLM's ``/tokenize`` on one backend
        (the first usable prefill server, else decode), within ``tokenize_timeout``."""
        if req.prompt_ids is not None:
            return req.prompt_ids
        if req.tokenize is None:
            return req.unkeyed or "unsupported_prompt"
        headers = {"Content-Type": "application/json"}
        if req.authorization is not None:
            headers[AUTHORIZATION] = req.authorization
        try:
            urls = self.pools["prefill"].candidates(None)
        except RouterError:
            try:
                urls = self.pools["decode"].candidates(None)
            except RouterError:
                return "tokenizer"
        timeout = aiohttp.ClientTimeout(total=self.settings.tokenize_timeout)
        t0 = time.perf_counter()
        try:
            async with self._session().post(urls[0] + "/tokenize",
                                         data=encode_json(req.tokenize),
                                         headers=headers, timeout=timeout) as resp:
                if resp.status != 200:
                    return "tokenizer"
                doc = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return "tokenizer"
        finally:
            turn.tokenize_s = time.perf_counter() - t0
        ids = doc.get("tokens") if isinstance(doc, dict) else None
        if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in ids):
            return "tokenizer"
        return tuple(ids)
