"""Fakes and a harness for the router tests: small fault-injecting OpenAI-subset backends
(no vLLM) and the router in front of them.

Each test runs one event loop with ``asyncio.run``: fake prefill/decode servers on
ephemeral ports, and the router in-process, served as ``kvtier router`` serves it.
Time-dependent behaviour (conversation TTL, backend cooldown) is driven by a
``ManualClock``; timeouts are short settings, never sleeps; a test waits for a fake
backend's events (a request arrived, it hangs, it was cancelled), never for time to pass.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kvtier.clock import ManualClock
from kvtier.router import RouterSettings
from kvtier.router.app import build_app
from kvtier.router.leases import ChainRenewer, Collector


def completion_of(prompt: str, n_words: int = 6) -> list[str]:
    """The fake model's deterministic answer to ``prompt``, as its stream pieces."""
    digest = hashlib.sha256(prompt.encode(errors="surrogatepass")).hexdigest()
    return [f" w{digest[i * 4:i * 4 + 4]}" for i in range(n_words)]


def key_of(text: str) -> str:
    return hashlib.sha256(text.encode(errors="surrogatepass")).hexdigest()[:32]


def prompt_of(body: dict[str, Any]) -> str:
    if "messages" in body:
        return "\n".join(str(m.get("content", "")) for m in body["messages"])
    return str(body["prompt"])


@dataclass
class Backend:
    """A fake vLLM server. ``mode``: ok, fail500, reject400, hang (before answering), stall
    (after the first streamed piece), break (mid-stream). Like vLLM, it aborts a request
    whose caller hung up (its handler is cancelled and ``cancelled`` set)."""

    mode: str = "ok"
    health: int = 200
    barrier: asyncio.Barrier | None = None  # streams wait here until all have arrived
    bodies: list[dict[str, Any]] = field(default_factory=list)
    auth: list[str | None] = field(default_factory=list)  # each call's Authorization header
    arrived: asyncio.Event = field(default_factory=asyncio.Event)  # set on each call
    hanging: asyncio.Event = field(default_factory=asyncio.Event)  # a call hangs or stalls
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)  # its caller hung up
    release: asyncio.Event = field(default_factory=asyncio.Event)
    last_key: str | None = None  # report this chain end instead of a hash of the text
    health_calls: int = 0  # GET /health answered

    async def wait_for_calls(self, n: int) -> None:
        while len(self.bodies) < n:
            self.arrived.clear()
            await self.arrived.wait()

    async def hang(self) -> None:
        """Wait for ``release``; set ``cancelled`` if the caller hangs up first."""
        self.hanging.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    def app(self) -> web.Application:
        app = web.Application(handler_args={"handler_cancellation": True})
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_get("/health", self.get_health)
        return app

    async def get_health(self, _request: web.Request) -> web.Response:
        self.health_calls += 1
        return web.json_response({}, status=self.health)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.auth.append(request.headers.get("Authorization"))
        self.arrived.set()
        if self.mode == "hang":
            await self.hang()  # released at teardown; the router gives up long before
        if self.mode == "fail500":
            return web.json_response({"error": {"message": "CUDA out of memory"}}, status=500)
        if self.mode == "reject400":
            return web.json_response({"error": {"message": "prompt too long"}}, status=400)
        prompt = prompt_of(body)
        pieces = completion_of(prompt)[: body.get("max_tokens") or 6]
        if body.get("stream"):
            return await self.stream(request, pieces)
        phase = body["kv_transfer_params"]["kvtier"]["phase"]
        text = prompt if phase == "prefill" else prompt + "".join(pieces)
        params = {"namespace": "ab" * 8, "tokens": len(text),
                  "last_key": self.last_key or key_of(text),
                  "expires_at": 0.0, "restored_tokens": 7, "restored_by_tier": {"file1": 7},
                  "restore_ms": 12.5}
        return web.json_response({"choices": [{"text": "".join(pieces)}],
                                  "kv_transfer_params": {"kvtier": params}})

    async def stream(self, request: web.Request, pieces: list[str]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if self.barrier is not None:
            await asyncio.wait_for(self.barrier.wait(), 10)
        for i, piece in enumerate(pieces):
            await resp.write(f"data: {json.dumps({'choices': [{'text': piece}]})}\n\n".encode())
            if self.mode == "break" and i == 1:
                raise ConnectionResetError("fake backend died mid-stream")
            if self.mode == "stall" and i == 0:
                await self.hang()
            await asyncio.sleep(0)  # yield, so concurrent streams interleave
        await resp.write(b"data: [DONE]\n\n")
        return resp


class RunAppServer(TestServer):
    """Serves an app as ``web.run_app`` (``kvtier router``) does. aiohttp's ``TestServer``
    cancels the handler of a client that went away, which ``run_app`` does not by default:
    the router must not depend on how it is served."""

    async def _make_runner(self, **kwargs: Any) -> web.BaseRunner:
        kwargs["handler_cancellation"] = False
        return await super()._make_runner(**kwargs)


@dataclass
class Harness:
    client: TestClient[web.Request, web.Application]
    prefill: Backend
    decode: Backend
    clock: ManualClock
    renewed: list[str]


@asynccontextmanager
async def harness(prefill: Backend | None = None, decode: Backend | None = None,
                  decode_urls: tuple[str, ...] | None = None, real_tiers: bool = False,
                  collector: Collector | None = None, renewer: ChainRenewer | None = None,
                  **settings: Any) -> AsyncIterator[Harness]:
    prefill, decode = prefill or Backend(), decode or Backend()
    servers = [TestServer(prefill.app()), TestServer(decode.app())]
    clock, renewed = ManualClock(), []

    def recording_renewer(last_key: str) -> int:
        renewed.append(last_key)
        return 3

    client: TestClient[web.Request, web.Application] | None = None
    try:
        for s in servers:
            await s.start_server()
        settings.setdefault("pd_mode", "always")  # most tests are about the P/D hand-off
        cfg = RouterSettings(prefill=(str(servers[0].make_url("")),),
                             decode=decode_urls or (str(servers[1].make_url("")),), **settings)
        app = build_app(cfg, clock=clock,
                        renewer=None if real_tiers else renewer or recording_renewer,
                        collector=collector)
        client = TestClient(RunAppServer(app))
        await client.start_server()
        yield Harness(client, prefill, decode, clock, renewed)
    finally:
        prefill.release.set()
        decode.release.set()
        if client is not None:
            await client.close()
        for s in servers:
            await s.close()


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(scenario())  # type: ignore[arg-type]


async def post(h: Harness, body: object, path: str = "/v1/completions",
               **headers: str) -> tuple[int, Any, dict[str, str]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with h.client.post(path, data=data, headers=headers) as resp:
        text = await resp.text()
        try:
            doc = json.loads(text)
        except ValueError:
            doc = text
        return resp.status, doc, dict(resp.headers)


async def stream_text(h: Harness, prompt: str, cid: str | None) -> tuple[int, str, bytes]:
    body: dict[str, Any] = {"prompt": prompt, "stream": True}
    if cid is not None:
        body["conversation_id"] = cid
    async with h.client.post("/v1/completions", json=body) as resp:
        raw = await resp.read()
    text = ""
    for event in raw.decode().split("\n\n"):
        payload = event.removeprefix("data: ")
        if event.startswith("data: ") and payload != "[DONE]":
            for choice in json.loads(payload).get("choices", []):  # an error event has none
                text += choice.get("text", "")
    return resp.status, text, raw
