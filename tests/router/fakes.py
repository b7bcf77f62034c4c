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
import dataclasses
import hashlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kvtier.clock import ManualClock
from kvtier.keys import ChunkKey, Namespace, chunk_keys, tail_key
from kvtier.router import RouterSettings
from kvtier.router.app import build_app
from kvtier.router.leases import ChainRenewer, Collector
from kvtier.tiers.file import FileTier
from tests.tiers.harness import meta_for, payload_for


def completion_of(prompt: str, n_words: int = 6) -> list[str]:
    """The fake model's deterministic answer to ``prompt``, as its stream pieces."""
    digest = hashlib.sha256(prompt.encode(errors="surrogatepass")).hexdigest()
    return [f" w{digest[i * 4:i * 4 + 4]}" for i in range(n_words)]


def key_of(text: str) -> str:
    return hashlib.sha256(text.encode(errors="surrogatepass")).hexdigest()[:32]


def ids_of(text: str) -> list[int]:
    """The fake tokenizer: one token per UTF-8 byte."""
    return list(text.encode(errors="surrogatepass"))


@dataclass
class KVStore:
    """What a fake engine does with a shared file tier: it stores each request's prompt
    (prefill) or prompt and answer (decode) as real kvtier chunk objects, keyed exactly as
    a kvtier engine keys them (``chunk_keys``, ``tail_key``, the namespace digest with the
    request's ``cache_salt`` and LoRA adapter), and reports them as a kvtier engine does."""

    tier: FileTier
    chunk_tokens: int = 16
    block_size: int = 4
    adapters: tuple[str, ...] = ()  # model names that are LoRA adapters
    epoch: int = 0

    def digest(self, body: dict[str, Any]) -> bytes:
        ns = Namespace(model="fake", model_fingerprint="0" * 16, kv_dtype="uint8",
                       kv_layout="NHD", num_layers=1, num_kv_heads=1, head_size=64,
                       chunk_tokens=self.chunk_tokens, block_size=self.block_size)
        model = body.get("model")
        adapter = f"{model}\x00fp" if model in self.adapters else None
        return ns.digest(body.get("cache_salt"), adapter=adapter, epoch=self.epoch)

    def save(self, body: dict[str, Any], ids: list[int]) -> dict[str, Any]:
        """Store ``ids`` down to a block boundary; the params the engine returns."""
        digest, ct = self.digest(body), self.chunk_tokens
        end = len(ids) // self.block_size * self.block_size
        n = end // ct
        keys = chunk_keys(digest, ids[: n * ct], ct)
        last: ChunkKey | None = keys[-1] if keys else None
        for i, key in enumerate(keys):
            self._put(key, digest, keys[i - 1] if i else None)
        if end > n * ct:
            last = tail_key(keys[-1] if keys else digest, ids[n * ct: end])
            self._put(last, digest, keys[-1] if keys else None)
        return {"namespace": digest.hex(), "tokens": end,
                "last_key": None if last is None else last.hex()}

    def _put(self, key: ChunkKey, digest: bytes, parent: ChunkKey | None) -> None:
        meta = dataclasses.replace(meta_for(key, 64, namespace=digest), parent=parent)
        self.tier.put(meta, payload_for(key, 64).data)


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
    kv: KVStore | None = None  # store chunks in a shared tier, as a kvtier engine does
    tokenize_mode: str = "ok"  # ok, fail500, hang
    tokenized: list[dict[str, Any]] = field(default_factory=list)  # /tokenize bodies

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
        app.router.add_post("/tokenize", self.tokenize)
        return app

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.tokenized.append(body)
        if self.tokenize_mode == "hang":
            await self.hang()
        if self.tokenize_mode == "fail500":
            return web.json_response({"error": {"message": "no tokenizer"}}, status=500)
        ids = ids_of(prompt_of(body))
        return web.json_response({"count": len(ids), "tokens": ids, "max_model_len": 1 << 20})

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
        phase = body["kv_transfer_params"]["kvtier"]["phase"]
        text = prompt if phase == "prefill" else prompt + "".join(pieces)
        ids = body["prompt"] if isinstance(body.get("prompt"), list) else ids_of(prompt)
        if phase != "prefill":
            ids = ids + ids_of("".join(pieces))
        saved = None if self.kv is None else self.kv.save(body, ids)
        if body.get("stream"):
            return await self.stream(request, pieces)
        params = {"namespace": "ab" * 8, "tokens": len(text),
                  "last_key": self.last_key or key_of(text),
                  "expires_at": 0.0, "restored_tokens": 7, "restored_by_tier": {"file1": 7},
                  "restore_ms": 12.5} | (saved or {})
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


def tiered_config(tmp_path: Path, chunk_tokens: int = 16) -> tuple[Path, FileTier]:
    """A kvtier config whose one shared tier is a file tier under ``tmp_path``, and that
    tier opened as a fake engine's (the caller closes it)."""
    store = tmp_path / "store"
    store.mkdir(exist_ok=True)
    config = tmp_path / "kvtier.yaml"
    config.write_text(f"chunk_tokens: {chunk_tokens}\ntiers:\n  - host: {{capacity: 64MiB}}\n"
                      f"  - file: {{path: {store}, capacity: 1GiB}}\n")
    return config, FileTier(store, 1 << 30)


@asynccontextmanager
async def tiered_harness(tmp_path: Path, prefill: Backend | None = None,
                         decode: Backend | None = None,
                         **settings: Any) -> AsyncIterator[Harness]:
    """The router in auto mode with ``--tiers`` over a file tier its fake engines write
    real chunk objects to (``KVStore``, chunks of 16 tokens, blocks of 4)."""
    config, tier = tiered_config(tmp_path)
    kv = KVStore(tier)
    prefill, decode = prefill or Backend(), decode or Backend()
    prefill.kv = decode.kv = kv
    settings.setdefault("pd_mode", "auto")
    try:
        async with harness(prefill, decode, real_tiers=True, tiers=config,
                           **settings) as h:
            yield h
    finally:
        tier.close()
