"""Router-issued tenant salts: keyed, so nobody without the secret can make one.

A tenant's ``cache_salt`` keeps its KV apart from every other tenant's (it is mixed into
every key). It used to be a plain hash of the tenant's name, which anyone can compute: a
client that reached a backend directly and sent ``salt_of("acme")`` restored acme's KV
(issue 47). Now the router issues

    kvtier-tenant-<id><mac>       id  = HMAC-SHA256(secret, "id\\0"  + tenant)[:16]
                                  mac = HMAC-SHA256(secret, "mac\\0" + id)[:16]

(hex, 64 characters after the prefix). Without the secret a salt can be neither derived
from a tenant's name nor made up: ``id`` hides the name, ``mac`` proves the router
issued it. An engine that holds the same secret checks the ``mac`` (``SaltCheck``) and,
with ``tenancy.require_router_salt``, touches no KV of a request whose salt it did not
issue (a client reaching the backend directly, a copied-and-edited salt); a salt copied
whole from another tenant's traffic still works there, as a key would: salts are
credentials, and the router never shows one to a client.

**Secrets** (``load_secrets``): one per line in a file (``--tenant-secret-file``,
``tenancy.secret_file``) or ``;``-separated in ``KVTIER_TENANT_SECRET``; at least 32
characters each. The first issues salts; the others are still accepted by engines,
for a rotation's overlap: add the new secret first on the engines, then on the router,
then drop the old one. A rotated secret changes every tenant's salt, so what was stored
under the old ones is recomputed, never served across tenants. A router with tenants
and no secret makes a random one (logged): salts then change at each restart and differ
between routers.

Threads: everything here is pure; any thread.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets as _secrets
from collections.abc import Sequence
from pathlib import Path

from kvtier.secretfile import secret_lines

PREFIX = "kvtier-tenant-"
ENV = "KVTIER_TENANT_SECRET"
MIN_SECRET_CHARS = 32
_PART = 16  # bytes of id and of mac


class SecretError(ValueError):
    """The tenant secret cannot be used; the message says where it came from and why."""


def load_secrets(path: Path | None, environ: dict[str, str] | None = None) -> list[bytes]:
    """The secrets from ``path`` (one a line; ``#`` comments and blank lines skipped),
    else from ``KVTIER_TENANT_SECRET`` (``;``-separated); [] if neither is set."""
    found, where = secret_lines(path, ENV, "tenant secret", SecretError, environ)
    for i, s in enumerate(found):
        if len(s) < MIN_SECRET_CHARS:
            raise SecretError(f"tenant secret {i + 1} in {where} has {len(s)} characters; "
                              f"use at least {MIN_SECRET_CHARS} (e.g. `openssl rand -hex 32`)")
    return [s.encode() for s in found]


def random_secret() -> bytes:
    return _secrets.token_hex(32).encode()


def _mac(secret: bytes, label: bytes, data: bytes) -> bytes:
    return hmac.new(secret, label + b"\0" + data, hashlib.sha256).digest()[:_PART]


def issue(secret: bytes, tenant: str) -> str:
    """``tenant``'s salt under ``secret`` (the same on every router holding it)."""
    ident = _mac(secret, b"id", tenant.encode())
    return PREFIX + ident.hex() + _mac(secret, b"mac", ident).hex()


def looks_issued(salt: str) -> bool:
    """Does ``salt`` carry the router's prefix (a client may not send such a salt)?"""
    return salt.startswith(PREFIX)


class SaltCheck:
    """Whether a salt was issued under one of ``secrets`` (an engine's check)."""

    def __init__(self, secrets: Sequence[bytes]) -> None:
        if not secrets:
            raise SecretError("checking router-issued salts needs a tenant secret: set "
                              f"tenancy.secret_file or {ENV}")
        self.secrets = list(secrets)

    def __call__(self, salt: object) -> bool:
        if not isinstance(salt, str) or not salt.startswith(PREFIX):
            return False
        body = salt[len(PREFIX):]
        if len(body) != 4 * _PART:
            return False
        try:
            ident, mac = bytes.fromhex(body[: 2 * _PART]), bytes.fromhex(body[2 * _PART:])
        except ValueError:
            return False
        return any(hmac.compare_digest(_mac(s, b"mac", ident), mac) for s in self.secrets)
