"""``kvtier router``: an HTTP proxy for prefill/decode disaggregated vLLM serving.

The router owns the P/D hand-off: it sends each request to a prefill server with
``max_tokens=1``, passes the ``kvtier`` params that server returns (namespace, token count,
last chunk key) to a decode server as ``expect``, and streams the decode answer back. KV
itself moves through the shared kvtier tiers, never through the router. A turn whose
uncached suffix is short goes straight to the decode server instead (``--pd-mode``,
``kvtier.router.selective``). With an API key (``--api-key``, default ``$VLLM_API_KEY`` as
for vLLM) or a tenants file (``--tenants``) every route but ``/health`` and ``/metrics``
needs a key; at most ``--max-concurrency`` requests are served at once.

This module is importable without aiohttp (the rest of the ``kvtier`` CLI must work where
aiohttp is not installed): it holds the settings and the command-line flags, and imports
``kvtier.router.app`` only when the router is built or served.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, get_args

from kvtier.router.conversations import DEFAULT_MAX_CONVERSATIONS
from kvtier.router.selective import (
    DEFAULT_MAX_DIRECT_TOKENS,
    DEFAULT_THRESHOLD_TOKENS,
    PD_MODES,
    PDMode,
)

if TYPE_CHECKING:
    from kvtier.router.app import build_app

__all__ = ["RouterSettings", "add_arguments", "build_app", "serve", "settings_from_args"]

DEFAULT_LEASE_SECONDS = 480.0
DEFAULT_MAX_CONCURRENCY = 256
DEFAULT_MAX_BODY_BYTES = 64 << 20
DEFAULT_BODY_TIMEOUT = 30.0
DEFAULT_RENEW_CONCURRENCY = 8  # chains one heartbeat renews at once
#: Token ids a prompt may have; longer ones get 400 before any work (a 64 MiB body of ids
#: is about ten million ids; a million is beyond any model's context today).
DEFAULT_MAX_PROMPT_TOKENS = 1 << 20
#: ``POST /v1/kvtier/renew`` calls a tenant (or, without tenants, all callers) may make
#: per second, with bursts of four times that; more get 429.
DEFAULT_RENEW_RATE = 5.0
API_KEY_ENV = "VLLM_API_KEY"  # the variable vLLM's own --api-key defaults to


@dataclass(frozen=True)
class RouterSettings:
    """Everything the router needs; validated once, here. Durations are in seconds."""

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    tiers: Path | None = None  # kvtier config whose shared tiers leases are renewed on
    lease_seconds: float = DEFAULT_LEASE_SECONDS
    conversation_ttl: float | None = None  # default 0.9 * lease_seconds
    heartbeat_seconds: float | None = None  # default lease_seconds / 4
    request_timeout: float = 600.0  # whole non-streamed call; gap between streamed chunks
    connect_timeout: float = 5.0
    health_timeout: float = 2.0
    backend_cooldown: float = 5.0  # a backend that refused or timed out is skipped this long
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_timeout: float = DEFAULT_BODY_TIMEOUT  # a client body must arrive within this
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY  # requests served at once; more get 503
    api_key: str | None = field(default=None, repr=False)  # None: no authentication
    tenants: Path | None = None  # API key -> tenant file; the api_key then goes to backends
    #: the secret tenants' salts are keyed by (``kvtier.tenancy``); else KVTIER_TENANT_SECRET
    tenant_secret_file: Path | None = None
    dp_reuse: bool = True  # False: prefill never restores (the "D->P off" baseline)
    collect: bool = True  # with tiers: each heartbeat removes objects past their lease
    pd_mode: PDMode = "auto"  # always: every turn P/D; never: every turn decode-only
    pd_default_threshold: int = DEFAULT_THRESHOLD_TOKENS  # until the costs are measured
    pd_max_direct_tokens: int = DEFAULT_MAX_DIRECT_TOKENS  # never decode-only above this
    max_conversations: int = DEFAULT_MAX_CONVERSATIONS
    #: with tenants: conversations one tenant may have tracked (default a quarter of
    #: max_conversations): a tenant past it drops its own least recently used one
    max_conversations_per_tenant: int | None = None
    renew_concurrency: int = DEFAULT_RENEW_CONCURRENCY
    renew_rate: float = DEFAULT_RENEW_RATE  # renew calls per second per tenant
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS
    health_interval: float = 1.0  # /health probes the backends at most this often
    tokenize_timeout: float = 1.0  # a prompt not tokenized within this takes the prefill hop
    probe_timeout: float = 0.1  # the held-prefix probe of the tier; what it confirmed counts

    def __post_init__(self) -> None:
        for role, urls in (("prefill", self.prefill), ("decode", self.decode)):
            for url in urls:
                if not url.startswith(("http://", "https://")):
                    raise ValueError(f"--{role} {url!r}: must be an http:// or https:// URL")
        for name in ("lease_seconds", "request_timeout", "connect_timeout", "health_timeout",
                     "body_timeout", "health_interval", "tokenize_timeout", "probe_timeout",
                     "renew_rate"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("conversation_ttl", "heartbeat_seconds"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.backend_cooldown < 0:
            raise ValueError(f"backend_cooldown must be >= 0, got {self.backend_cooldown}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        for name in ("max_concurrency", "max_body_bytes", "max_conversations",
                     "renew_concurrency", "max_prompt_tokens", "max_conversations_per_tenant"):
            value = getattr(self, name)
            if value is None and name == "max_conversations_per_tenant":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("pd_default_threshold", "pd_max_direct_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.pd_mode not in get_args(PDMode):
            raise ValueError(f"pd_mode must be one of {list(PD_MODES)}, got {self.pd_mode!r}")
        key = self.api_key
        if key is not None and (not key or not key.isprintable() or any(c.isspace() for c in key)):
            raise ValueError("api_key must be non-empty printable text without spaces "
                             "(leave it unset to turn authentication off)")

    @property
    def ttl_seconds(self) -> float:
        return self.conversation_ttl or 0.9 * self.lease_seconds

    @property
    def tenant_conversations(self) -> int:
        """Conversations one tenant may have tracked."""
        if self.max_conversations_per_tenant is not None:
            return min(self.max_conversations_per_tenant, self.max_conversations)
        return max(1, self.max_conversations // 4)

    @property
    def heartbeat_interval(self) -> float:
        return self.heartbeat_seconds or self.lease_seconds / 4


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``kvtier router`` flags (no positional config: ``--tiers`` is optional)."""
    p.add_argument("--prefill", action="append", required=True, metavar="URL",
                   help="a prefill vLLM server, e.g. http://10.0.0.1:8100 (repeatable)")
    p.add_argument("--decode", action="append", required=True, metavar="URL",
                   help="a decode vLLM server (repeatable)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--tiers", type=Path, default=None, metavar="PATH",
                   help="kvtier config; enables lease renewal of tracked conversations")
    p.add_argument("--lease-seconds", type=float, default=None,
                   help="storage lease (default: retention.lease_seconds of --tiers, else 480)")
    p.add_argument("--request-timeout", type=float, default=600.0, metavar="S")
    p.add_argument("--connect-timeout", type=float, default=5.0, metavar="S")
    p.add_argument("--heartbeat-seconds", type=float, default=None, metavar="S",
                   help="lease renewal period (default lease/4)")
    p.add_argument("--backend-cooldown", type=float, default=5.0, metavar="S",
                   help="skip a backend this long after it refused a connection or timed out")
    p.add_argument("--max-concurrency", type=int, default=DEFAULT_MAX_CONCURRENCY, metavar="N",
                   help="requests served at once; one more is answered 503 with Retry-After "
                        f"(default {DEFAULT_MAX_CONCURRENCY})")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but /health and "
                        f"/metrics (default: ${API_KEY_ENV}; prefer the variable, as flags "
                        "show in the process list)")
    p.add_argument("--no-dp-reuse", dest="dp_reuse", action="store_false",
                   help="prefill recomputes instead of loading stored KV (a baseline)")
    p.add_argument("--no-collect", dest="collect", action="store_false",
                   help="do not remove objects past their lease on each heartbeat (when "
                        "`kvtier gc --expired` runs elsewhere)")
    p.add_argument("--tenants", type=Path, default=None, metavar="FILE",
                   help="YAML/JSON file 'keys: {<api key>: <tenant>}': clients authenticate "
                        "with a tenant's key and the router sets cache_salt per tenant; "
                        "reloaded on SIGHUP or when the file changes. --api-key, if any, is "
                        "then the key the router sends to the vLLM servers")
    p.add_argument("--pd-mode", choices=PD_MODES, default="auto",
                   help="auto: per turn, decode-only when the uncached suffix is short "
                        "(default); always: prefill then decode; never: decode-only")
    p.add_argument("--pd-default-threshold", type=int, default=DEFAULT_THRESHOLD_TOKENS,
                   metavar="TOKENS", help="auto's threshold until prefill costs are measured "
                   f"(default {DEFAULT_THRESHOLD_TOKENS})")
    p.add_argument("--pd-max-direct-tokens", type=int, default=DEFAULT_MAX_DIRECT_TOKENS,
                   metavar="TOKENS", help="auto never sends a longer uncached suffix to the "
                   f"decode node (default {DEFAULT_MAX_DIRECT_TOKENS})")
    p.add_argument("--tokenize-timeout", type=float, default=1.0, metavar="S",
                   help="auto: a prompt vLLM's /tokenize has not answered within this takes "
                        "the prefill hop (default 1)")
    p.add_argument("--probe-timeout", type=float, default=0.1, metavar="S",
                   help="auto: the held-prefix lookup asks the tier for at most this long, "
                        "then counts what it confirmed (default 0.1)")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   metavar="BYTES", help="larger request bodies get 413 (default 64 MiB)")
    p.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT, metavar="S",
                   help="a request body must arrive within this, else 408 "
                        f"(default {DEFAULT_BODY_TIMEOUT:g})")
    p.add_argument("--max-conversations", type=int, default=DEFAULT_MAX_CONVERSATIONS,
                   metavar="N", help="conversations tracked at once; the least recently "
                   f"used one is dropped past it (default {DEFAULT_MAX_CONVERSATIONS})")
    p.add_argument("--tenant-secret-file", type=Path, default=None, metavar="PATH",
                   help="with --tenants: the secret tenants' cache salts are keyed by, one "
                   "a line (the first issues; the rest are for a rotation's overlap on "
                   "engines); else KVTIER_TENANT_SECRET; else a random one per start")
    p.add_argument("--max-conversations-per-tenant", type=int, default=None, metavar="N",
                   help="with --tenants: conversations one tenant may have tracked; past "
                   "it the tenant's own least recently used one is dropped (default a "
                   "quarter of --max-conversations)")
    p.add_argument("--renew-rate", type=float, default=DEFAULT_RENEW_RATE, metavar="PER_S",
                   help="POST /v1/kvtier/renew calls per second per tenant (bursts of "
                   f"4x); more get 429 (default {DEFAULT_RENEW_RATE:g})")
    p.add_argument("--max-prompt-tokens", type=int, default=DEFAULT_MAX_PROMPT_TOKENS,
                   metavar="N", help="prompts of more token ids get 400 before any work "
                   f"(default {DEFAULT_MAX_PROMPT_TOKENS})")
    p.add_argument("--renew-concurrency", type=int, default=DEFAULT_RENEW_CONCURRENCY,
                   metavar="N", help="chains a heartbeat renews at once "
                   f"(default {DEFAULT_RENEW_CONCURRENCY})")


def settings_from_args(args: argparse.Namespace) -> RouterSettings:
    lease: float | None = args.lease_seconds
    if lease is None and args.tiers is not None:
        from kvtier.config import load_config

        lease = load_config(args.tiers).retention.lease_seconds
    return RouterSettings(
        prefill=tuple(args.prefill),
        decode=tuple(args.decode),
        host=args.host,
        port=args.port,
        tiers=args.tiers,
        lease_seconds=lease or DEFAULT_LEASE_SECONDS,
        heartbeat_seconds=args.heartbeat_seconds,
        request_timeout=args.request_timeout,
        connect_timeout=args.connect_timeout,
        backend_cooldown=args.backend_cooldown,
        max_concurrency=args.max_concurrency,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        tenants=args.tenants,
        tenant_secret_file=args.tenant_secret_file,
        dp_reuse=args.dp_reuse,
        collect=args.collect,
        pd_mode=args.pd_mode,
        pd_default_threshold=args.pd_default_threshold,
        pd_max_direct_tokens=args.pd_max_direct_tokens,
        max_body_bytes=args.max_body_bytes,
        body_timeout=args.body_timeout,
        max_conversations=args.max_conversations,
        max_conversations_per_tenant=args.max_conversations_per_tenant,
        renew_concurrency=args.renew_concurrency,
        renew_rate=args.renew_rate,
        max_prompt_tokens=args.max_prompt_tokens,
        tokenize_timeout=args.tokenize_timeout,
        probe_timeout=args.probe_timeout,
    )


def serve(args: argparse.Namespace) -> int:
    """Run the router until interrupted. Raises ``ValueError``/``ConfigError`` on bad flags."""
    settings = settings_from_args(args)
    from aiohttp import web

    from kvtier.router.app import build_app

    logging.getLogger("kvtier.router").setLevel(logging.INFO)
    web.run_app(build_app(settings), host=settings.host, port=settings.port, access_log=None)
    return 0


def __getattr__(name: str) -> object:
    if name == "build_app":
        from kvtier.router import app

        return app.build_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
