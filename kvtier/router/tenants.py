"""Tenants: which API key belongs to whom, and the cache salt that keeps their KV apart.

The tenants file (``--tenants FILE``; JSON if it ends in ``.json``, else YAML) is one
mapping, ``keys``, from API key to tenant name::

    keys:
      sk-acme-7f3c9a0e5d1b4c2a: acme
      sk-acme-second-key-0001: acme      # two keys, one tenant: they share KV
      sk-globex-91d0c4b2e6f8a3: globex

Invariants:

* A key is 16..512 printable ASCII characters without spaces (what fits a Bearer token);
  a tenant name is 1..64 of ``A-Z a-z 0-9 . _ -``; a key appears once; nothing else is in
  the file. Anything else is a ``TenantsError`` naming the file and the entry (by position
  and tenant, never by key: keys are secrets and errors end up in logs).
* ``TenantMap.authenticate`` looks the SHA-256 of the presented token up in a dict keyed
  by each key's SHA-256: O(1) per request, refused ones included, whatever the number of
  keys (it compared with every key before: N comparisons per request on the event loop;
  issue 32). Its time depends on the presented token's digest only: how much of a key's
  *digest* a token's digest shares tells nothing about the key itself (finding a token
  for a digest is a preimage search), so it tells nothing about which key, or how much
  of one, a token matched; the key's length is never compared.
* A tenant's salt is a keyed MAC of its name under the router's secret
  (``TenantSalts``, ``kvtier.tenancy``): the same on every router process and restart
  that holds the secret (stored KV stays reachable), different for every tenant, never
  the client's, and not computable from the name without the secret.
* ``TenantRegistry`` holds the current map. A reload (SIGHUP, or the file's size, mtime or
  inode changed, looked at most every ``check_interval`` seconds of the injected clock)
  replaces it whole; a file that fails to load leaves the previous map in place and is
  logged with the reason, and the next change or SIGHUP tries again.
* Threads: the registry belongs to the event loop's thread; only the file read itself runs
  in a worker thread (``refresh``). ``request_reload`` may be called from a signal handler
  on the loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvtier.clock import Clock

log = logging.getLogger(__name__)

MIN_KEY_CHARS = 16
MAX_KEY_CHARS = 512
TENANT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
MAX_FILE_BYTES = 4 << 20


class TenantsError(ValueError):
    """A tenants file that cannot be used; the message names the file and what is wrong."""


class TenantSalts:
    """Each tenant's ``cache_salt``, issued under the router's secret
    (``kvtier.tenancy``): the same on every router holding the secret and across
    restarts, different for every tenant, never derivable from a name without it.
    Without a secret one is made at random (logged once): salts then change at every
    restart. Event loop thread only (a small cache)."""

    MAX_CACHED = 65536

    def __init__(self, secret_file: Path | None) -> None:
        from kvtier.tenancy import ENV, load_secrets, random_secret

        found = load_secrets(secret_file)
        if found:
            self.secret = found[0]
        else:
            self.secret = random_secret()
            log.warning("router: no tenant secret (--tenant-secret-file or %s); made a "
                        "random one, so tenants' salts, and the KV stored under them, "
                        "change at every restart and differ between routers", ENV)
        self._cache: dict[str, str] = {}

    def salt_of(self, tenant: str) -> str:
        got = self._cache.get(tenant)
        if got is None:
            from kvtier.tenancy import issue

            if len(self._cache) >= self.MAX_CACHED:
                self._cache.clear()
            got = self._cache[tenant] = issue(self.secret, tenant)
        return got


def key_digest(token: str) -> bytes:
    """The SHA-256 of a key or presented token: what is compared, never the text."""
    return hashlib.sha256(token.encode(errors="surrogatepass")).digest()


@dataclass(frozen=True)
class TenantMap:
    """API key digests and their tenants; immutable, replaced whole on reload."""

    entries: tuple[tuple[bytes, str], ...]
    _by_digest: dict[bytes, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_digest", dict(self.entries))

    @property
    def tenants(self) -> frozenset[str]:
        return frozenset(t for _, t in self.entries)

    def authenticate(self, token: str) -> str | None:
        """The tenant whose key ``token`` is, else ``None``: one dict lookup by the
        token's digest (see the module invariants)."""
        return self._by_digest.get(key_digest(token))


class _UniqueKeyLoader(yaml.SafeLoader):
    """A YAML loader that refuses a mapping with a repeated key."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node)  # type: ignore[no-untyped-call]
        if not isinstance(key, str | int | float | bool) and key is not None:
            raise yaml.constructor.ConstructorError(
                None, None, "a mapping key must be a plain scalar", key_node.start_mark)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, "a key appears twice in one mapping", key_node.start_mark)
        seen[key] = loader.construct_object(value_node)  # type: ignore[no-untyped-call]
    return seen


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                                 _construct_mapping)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError("a key appears twice in one object")
        out[k] = v
    return out


def parse_tenants(text: str, source: str, *, json_format: bool = False) -> TenantMap:
    """The map in ``text`` (the file's content; ``source`` names it in errors)."""
    def bad(what: str) -> TenantsError:
        return TenantsError(f"tenants file {source}: {what}")

    try:
        if json_format:
            doc = json.loads(text, object_pairs_hook=_no_duplicates)
        else:
            doc = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader
    except (ValueError, yaml.YAMLError) as e:
        raise bad(f"not valid {'JSON' if json_format else 'YAML'}: "
                  f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if not isinstance(doc, dict):
        raise bad('must be a mapping with one entry, "keys: {<api key>: <tenant>, ...}", '
                  f"got {type(doc).__name__}")
    unknown = sorted(str(k) for k in doc if k != "keys")
    if unknown:
        raise bad(f"unknown entries {unknown}; the only entry is 'keys'")
    keys = doc.get("keys")
    if not isinstance(keys, dict) or not keys:
        raise bad("'keys' must be a non-empty mapping of API key to tenant name")
    return TenantMap(tuple(_entry(i, k, v, bad) for i, (k, v) in enumerate(keys.items(), 1)))


def _entry(position: int, key: object, tenant: object,
           bad: Callable[[str], TenantsError]) -> tuple[bytes, str]:
    where = f"keys entry {position}"
    if not isinstance(tenant, str) or not TENANT_NAME.fullmatch(tenant):
        raise bad(f"{where}: the tenant name must be 1-64 characters of A-Z a-z 0-9 . _ -, "
                  f"got {tenant!r}")
    where += f" (tenant {tenant!r})"
    if not isinstance(key, str):
        raise bad(f"{where}: the API key must be text, got {type(key).__name__}")
    if not MIN_KEY_CHARS <= len(key) <= MAX_KEY_CHARS:
        raise bad(f"{where}: the API key must be {MIN_KEY_CHARS}-{MAX_KEY_CHARS} characters, "
                  f"got {len(key)}")
    if not (key.isascii() and key.isprintable()) or any(c.isspace() for c in key):
        raise bad(f"{where}: the API key must be printable ASCII without spaces")
    return key_digest(key), tenant


def load_tenants(path: Path) -> TenantMap:
    """Read and parse the tenants file; ``TenantsError`` if it cannot be used. Blocking."""
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise TenantsError(f"tenants file {path}: cannot read it: {e.strerror or e}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise TenantsError(f"tenants file {path}: larger than {MAX_FILE_BYTES} bytes")
    try:
        text = raw.decode()
    except UnicodeDecodeError as e:
        raise TenantsError(f"tenants file {path}: not UTF-8 text ({e.reason} at byte "
                           f"{e.start})") from None
    return parse_tenants(text, str(path), json_format=path.suffix.lower() == ".json")


FileStamp = tuple[int, int, int, int]  # (device, inode, size, mtime_ns)


def _stamp(path: Path) -> FileStamp | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class TenantRegistry:
    """The current ``TenantMap`` of a file, reloaded without a restart (see the module)."""

    def __init__(self, path: Path, clock: Clock, *, check_interval: float = 1.0,
                 loaded: Callable[[str], None] | None = None) -> None:
        """Loads the file now; raises ``TenantsError`` if it cannot be used. ``loaded`` is
        called with ``"ok"`` or ``"error"`` after every load (for the metrics)."""
        self.path, self.clock, self.check_interval = path, clock, check_interval
        self._loaded = loaded or (lambda _result: None)
        stamp = _stamp(path)
        self.map = load_tenants(path)
        self._stamp = stamp
        self._loaded("ok")
        self._checked = clock.monotonic()
        self._reload_requested = False
        self._refreshing: asyncio.Task[None] | None = None

    def authenticate(self, token: str) -> str | None:
        return self.map.authenticate(token)

    def request_reload(self) -> None:
        """Reload at the next ``refresh`` whatever the file's stamp (SIGHUP)."""
        self._reload_requested = True

    def due(self) -> bool:
        return (self._reload_requested
                or self.clock.monotonic() - self._checked >= self.check_interval)

    async def refresh(self) -> None:
        """If due, look at the file (in a worker thread) and reload it if it changed or a
        reload was requested. Concurrent callers share one look."""
        if not self.due():
            return
        if self._refreshing is None:
            self._refreshing = asyncio.create_task(self._refresh())
        task = self._refreshing
        try:
            await asyncio.shield(task)
        finally:
            if task.done() and self._refreshing is task:
                self._refreshing = None

    async def _refresh(self) -> None:
        forced, self._reload_requested = self._reload_requested, False
        self._checked = self.clock.monotonic()
        stamp = await asyncio.to_thread(_stamp, self.path)
        if not forced and stamp == self._stamp:
            return
        self._stamp = stamp  # a bad file is tried again only once it changes (or SIGHUP)
        try:
            new = await asyncio.to_thread(load_tenants, self.path)
        except TenantsError as e:
            self._loaded("error")
            log.error("%s; keeping the previous %d keys", e, len(self.map.entries))
            return
        self.map = new
        self._loaded("ok")
        log.info("tenants file %s reloaded: %d keys, %d tenants", self.path,
                 len(new.entries), len(new.tenants))


def tenants_of(mapping: Mapping[str, str]) -> TenantMap:
    """A map from ``{api key: tenant}`` directly (tests, embedding); validated alike."""
    return parse_tenants(json.dumps({"keys": dict(mapping)}), "<mapping>", json_format=True)
