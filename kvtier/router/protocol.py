"""The router's HTTP contract: what clients may send, what backends are sent, error answers.

Invariants:

* A client body is parsed once and serialized once: ``ProxyRequest.rest`` is the client's
  JSON object, minus ``conversation_id`` and the few small fields a prefill call changes
  (``PHASE_FIELDS``, kept in ``ProxyRequest.own``), encoded when the request is parsed.
  ``prefill_body``/``decode_body`` splice a small encoded object onto it; the prompt or
  messages, which make up nearly all of a body (up to ``max_body_bytes``), are never
  encoded again.
* A prefill call always has ``stream=False``, ``max_tokens=1`` and
  ``kv_transfer_params={"kvtier": {"phase": "prefill"}}``; a decode call carries the
  prefill's ``namespace``/``tokens``/``last_key`` as ``expect`` (or no ``expect`` if the
  prefill server returned none). ``kv_transfer_params`` from clients are refused.
* Every client error is a ``RouterError(400)`` (413 for an oversized body) whose message
  names the offending field; the router answers it as an OpenAI-style JSON error.
* A conversation id is 1..``MAX_CONVERSATION_ID`` printable characters (no control or
  format characters such as a newline or a bidi override), so it can be logged and used as
  a map key; it is still logged quoted (``repr``), being the client's text.
* The caller's ``Authorization`` header goes to both backends unchanged (vLLM servers
  started with ``--api-key`` need it); no other client header is forwarded. With tenants
  the router replaces it (``kvtier.router.tenants``): a tenant's key never leaves it.
* With a tenant, ``cache_salt`` is the tenant's salt, whatever the client sent or left out:
  tenants never share KV, and requests of one tenant do.
* ``prompt_bytes`` is the UTF-8 size of the prompt text (chat: the message contents), and
  ``prompt_tokens`` the exact count when the client sent token ids; the router estimates
  tokens from them (``kvtier.router.selective.Estimator``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeGuard

from aiohttp import web

from kvtier.router import DEFAULT_MAX_PROMPT_TOKENS
from kvtier.router.prefix import Identity, Unkeyed, identity_of
from kvtier.tenancy import PREFIX, looks_issued

Endpoint = Literal["completions", "chat"]

CONVERSATION_HEADER = "X-Conversation-Id"
STATE_HEADER = "X-KVTier-Conversation"
AUTHORIZATION = "Authorization"
PATHS: Mapping[Endpoint, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
REQUIRED: Mapping[Endpoint, str] = {"completions": "prompt", "chat": "messages"}
MAX_CONVERSATION_ID = 256


class RouterError(Exception):
    """An error the router answers itself, as an OpenAI-style JSON error."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.headers = dict(headers or {})

    def response(self) -> web.Response:
        body = {"error": {"message": self.message, "type": self.kind, "code": self.status}}
        return web.json_response(body, status=self.status, headers=self.headers)


class BackendRejected(Exception):
    """A backend answered 4xx: its status and body go back to the client unchanged."""

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"backend answered {status}")
        self.status, self.body, self.content_type = status, body, content_type

    def response(self) -> web.Response:
        return web.Response(status=self.status, body=self.body, content_type=self.content_type)


# -- request parsing ---------------------------------------------------------------------


# The client fields a prefill call changes or drops. All small; every other field (the
# prompt or messages above all) is encoded once, into ``ProxyRequest.rest``.
PHASE_FIELDS = ("stream", "stream_options", "min_tokens", "max_tokens", "max_completion_tokens")


@dataclass(frozen=True)
class ProxyRequest:
    endpoint: Endpoint
    stream: bool
    conversation_id: str | None
    own: Mapping[str, Any]  # the client's ``PHASE_FIELDS`` that it set; never mutated
    rest: bytes  # every other client field but ``conversation_id``, as one JSON object
    authorization: str | None = None  # the caller's header, forwarded to the backends
    prompt_bytes: int = 0  # UTF-8 bytes of the prompt text (chat: of the contents)
    prompt_tokens: int | None = None  # exact, when the prompt is token ids
    identity: Identity = (None, None)  # (cache_salt, model): selects the namespace
    prompt_ids: tuple[int, ...] | None = None  # the prompt's ids, when the client sent them
    #: the vLLM ``/tokenize`` body giving the prompt's ids (encoded only when sent: auto mode)
    tokenize: Mapping[str, Any] | None = None
    unkeyed: Unkeyed | None = None  # why the prompt's keys cannot be computed, if so


def encode_json(doc: object) -> bytes:
    """Compact UTF-8 JSON (``ensure_ascii`` would grow non-ASCII text up to 6x). A lone
    surrogate (valid in JSON as an escape, not in UTF-8) is kept as its escape."""
    text = json.dumps(doc, ensure_ascii=False, separators=(",", ":"))
    try:
        return text.encode()
    except UnicodeEncodeError:
        return json.dumps(doc, separators=(",", ":")).encode()


def _splice(rest: bytes, fields: Mapping[str, Any]) -> bytes:
    """The JSON object ``rest`` with ``fields`` (keys not in ``rest``) added, without
    encoding ``rest`` again."""
    extra = encode_json(dict(fields))
    if extra == b"{}":
        return rest
    if rest == b"{}":
        return extra
    return rest[:-1] + b"," + extra[1:]


def _bad(message: str) -> RouterError:
    return RouterError(400, message)


def _check_conversation_id(value: object, source: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _bad(f"{source} must be a non-empty string, got {value!r}")
    if len(value) > MAX_CONVERSATION_ID:
        raise _bad(f"{source} must be at most {MAX_CONVERSATION_ID} characters, "
                   f"got {len(value)}")
    if not value.isprintable():
        raise _bad(f"{source} must not contain control or format characters, got {value!r}")
    return value


def _check_token_limit(body: Mapping[str, Any], name: str) -> None:
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _bad(f"'{name}' must be a positive integer, got {value!r}")


async def read_body(request: web.Request, timeout: float | None = None) -> bytes:
    """The raw request body; ``RouterError(413)`` if it exceeds the app's size limit,
    ``RouterError(408)`` if it did not arrive within ``timeout`` seconds."""
    try:
        async with asyncio.timeout(timeout):
            return await request.read()
    except web.HTTPRequestEntityTooLarge as e:
        raise RouterError(413, f"request body too large: {e.text} (--max-body-bytes)") from None
    except TimeoutError:
        raise RouterError(408, f"request body not received within {timeout:g}s "
                          "(--body-timeout)", "timeout",
                          {"Connection": "close"}) from None


def _text_bytes(value: object) -> int:
    """UTF-8 bytes of the text in a prompt, message content, or list of content parts."""
    if isinstance(value, str):
        return len(value.encode(errors="surrogatepass"))
    if isinstance(value, list):
        return sum(_text_bytes(v) for v in value)
    if isinstance(value, dict):
        return _text_bytes(value.get("text")) + _text_bytes(value.get("content"))
    return 0


def prompt_size(endpoint: Endpoint, body: Mapping[str, Any]) -> tuple[int, int | None]:
    """``(bytes of prompt text, exact tokens or None)`` of a parsed client body."""
    if endpoint == "chat":
        return _text_bytes(body.get("messages")), None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return 0, len(prompt)
    return _text_bytes(prompt), None


#: Token ids are keyed as little-endian uint32 (``kvtier.keys.encode_tokens``).
TOKEN_ID_LIMIT = 2**32


def _check_ids(ids: Sequence[int], limit: int) -> None:
    """``RouterError(400)`` unless ``ids`` are at most ``limit`` ids in ``[0, 2**32)``."""
    if len(ids) > limit:
        raise _bad(f"'prompt' has {len(ids)} token ids; the router takes at most {limit} "
                   "(--max-prompt-tokens)")
    if min(ids) < 0 or max(ids) >= TOKEN_ID_LIMIT:
        bad = next(i for i, t in enumerate(ids) if not 0 <= t < TOKEN_ID_LIMIT)
        raise _bad(f"'prompt' token id {ids[bad]} at position {bad} is out of range: token "
                   f"ids are integers in [0, {TOKEN_ID_LIMIT})")


def parse_request(endpoint: Endpoint, raw: bytes, headers: Mapping[str, str], *,
                  salt: str | None = None,
                  max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS) -> ProxyRequest:
    """Validate a client body (and its conversation header), and encode it for the backends
    once; raises ``RouterError(400)`` naming the offending field (token ids out of range
    or more than ``max_prompt_tokens`` of them, too). A ``salt`` (the tenant's) replaces
    the client's ``cache_salt``."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise _bad(f"request body is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise _bad(f"request body must be a JSON object, got {type(doc).__name__}")
    body: dict[str, Any] = doc  # freshly parsed: ours to change
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
    header_id = headers.get(CONVERSATION_HEADER)
    if "conversation_id" in body:
        cid = _check_conversation_id(body.pop("conversation_id"), "'conversation_id'")
    elif header_id is not None:
        cid = _check_conversation_id(header_id, f"header {CONVERSATION_HEADER}")
    if salt is not None:
        body["cache_salt"] = salt
    elif isinstance(body.get("cache_salt"), str) and looks_issued(body["cache_salt"]):
        raise _bad(f"'cache_salt' may not start with {PREFIX!r}: that prefix is for the "
                   "salts the router issues to tenants; choose another salt")
    own = {k: body.pop(k) for k in PHASE_FIELDS if k in body}
    size, exact = prompt_size(endpoint, body)
    ids = tuple(body["prompt"]) if exact is not None else None
    if ids is not None:
        _check_ids(ids, max_prompt_tokens)
    tokenize, unkeyed = (None, None) if ids is not None else tokenize_request(endpoint, body)
    return ProxyRequest(endpoint, stream, cid, own, encode_json(body),
                        headers.get(AUTHORIZATION), size, exact, identity_of(body), ids,
                        tokenize, unkeyed)


#: The chat fields vLLM's ``/tokenize`` takes besides ``messages``: those that change how
#: the chat template renders the prompt (``vllm.entrypoints.serve.tokenize.protocol``).
TOKENIZE_CHAT_FIELDS = ("model", "add_generation_prompt", "continue_final_message",
                        "add_special_tokens", "chat_template", "chat_template_kwargs",
                        "tools", "mm_processor_kwargs")
#: Chat fields that change the rendered prompt which ``/tokenize`` does not take.
UNTOKENIZABLE_CHAT_FIELDS = ("documents",)


def _multimodal(messages: object) -> bool:
    """Whether any message has a content part other than text."""
    if not isinstance(messages, list):
        return False
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(
                not isinstance(p, dict | str) or (isinstance(p, dict)
                                                  and p.get("type", "text") != "text")
                for p in content):
            return True
    return False


def tokenize_request(endpoint: Endpoint,
                     body: Mapping[str, Any]) -> tuple[dict[str, Any] | None, Unkeyed | None]:
    """The vLLM ``/tokenize`` body that gives the ids the engine will hash for this
    completion request, or why there is none: ``multimodal`` (images, audio, ... are keyed
    by their content, which only the engine sees), ``unsupported_prompt`` (a batch of
    prompts, prompt embeddings, or template fields ``/tokenize`` does not take)."""
    if endpoint == "chat":
        messages = body.get("messages")
        if _multimodal(messages):
            return None, "multimodal"
        if not isinstance(messages, list) or any(f in body for f in UNTOKENIZABLE_CHAT_FIELDS):
            return None, "unsupported_prompt"
        return {"messages": messages} | {f: body[f] for f in TOKENIZE_CHAT_FIELDS
                                         if f in body}, None
    prompt = body.get("prompt")
    if "prompt_embeds" in body or "multi_modal_data" in body:
        return None, "multimodal" if "multi_modal_data" in body else "unsupported_prompt"
    if not isinstance(prompt, str):
        return None, "unsupported_prompt"
    return {"prompt": prompt} | {f: body[f] for f in ("model", "add_special_tokens")
                                 if f in body}, None


def parse_renew(raw: bytes) -> str:
    """The conversation id of a ``POST /v1/kvtier/renew`` body; ``RouterError(400)`` if bad."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise _bad(f"request body is not valid JSON: {e}") from None
    if not isinstance(doc, dict) or "conversation_id" not in doc:
        raise _bad('body must be {"conversation_id": "..."}')
    return _check_conversation_id(doc["conversation_id"], "'conversation_id'")


# -- backend bodies and answers ------------------------------------------------------------


def prefill_body(req: ProxyRequest, *, reuse: bool = True) -> bytes:
    """The encoded prefill call: one unstreamed token (``stream_options`` and ``min_tokens``,
    which would be refused with ``max_tokens=1``, are dropped)."""
    fields: dict[str, Any] = {"stream": False, "max_tokens": 1}
    limit = req.own.get("max_completion_tokens")
    if limit is not None:  # chat's name for max_tokens; completions passes it on unchanged
        fields["max_completion_tokens"] = 1 if req.endpoint == "chat" else limit
    kvtier: dict[str, Any] = {"phase": "prefill"}
    if not reuse:
        kvtier["load"] = False
    fields["kv_transfer_params"] = {"kvtier": kvtier}
    return _splice(req.rest, fields)


def decode_body(req: ProxyRequest, handoff: Mapping[str, Any] | None) -> bytes:
    """The encoded decode call: the client's request plus the prefill's ``expect``."""
    kvtier: dict[str, Any] = {"phase": "decode"}
    if handoff is not None:
        kvtier["expect"] = {k: handoff.get(k) for k in ("namespace", "tokens", "last_key")}
    return _splice(req.rest, {**req.own, "kv_transfer_params": {"kvtier": kvtier}})


@dataclass(frozen=True)
class PromptUsage:
    """A response's ``usage`` about its prompt: ``prompt_tokens`` (exact), and
    ``cached_tokens``, the tokens vLLM served without computing them (its own prefix cache
    plus the connector's loads), present only where the server runs with
    ``--enable-prompt-tokens-details``."""

    prompt_tokens: int
    cached_tokens: int | None = None


def prompt_usage(doc: object) -> PromptUsage | None:
    """``doc["usage"]`` as a ``PromptUsage``; None where it has no positive integer
    ``prompt_tokens``."""
    usage = doc.get("usage") if isinstance(doc, dict) else None
    if not isinstance(usage, dict):
        return None
    prompt, details = usage.get("prompt_tokens"), usage.get("prompt_tokens_details")
    if not _count(prompt) or prompt <= 0:
        return None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return PromptUsage(prompt, cached if _count(cached) and cached <= prompt else None)


def _count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def kvtier_params(doc: object) -> dict[str, Any] | None:
    """``doc["kv_transfer_params"]["kvtier"]`` if it is there and a dict."""
    ktp = doc.get("kv_transfer_params") if isinstance(doc, dict) else None
    params = ktp.get("kvtier") if isinstance(ktp, dict) else None
    return params if isinstance(params, dict) else None


def param_number(params: Mapping[str, Any] | None, name: str) -> float:
    """``params[name]`` if it is a number (not a bool), else 0."""
    value = params.get(name) if params is not None else None
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0
