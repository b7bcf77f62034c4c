"""The one YAML file that configures kvtier, parsed into frozen, validated models.

Invariants:

* Unknown keys are errors, everywhere (``extra="forbid"``).
* Every error names the field path and what is wrong, e.g.
  ``tiers[1].s3.bucket: Field required``, and the whole list is reported at once. No
  error ever quotes an input value: a secret typed in the wrong place (a key under a
  tier) must not reach a log. YAML syntax errors give the line and column, not the text.
* Sizes are written like ``32GiB``; they must be positive and below ``MAX_SIZE``.
* Overrides come from ``KVTIER__A__B=value`` environment variables and from dotted keys
  (``{"restore.recompute_threshold_tokens": 32}``) given by the vLLM connector; both are
  applied to the raw document before validation, so they are validated like the file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

from kvtier.sizes import parse_size

MAX_SIZE = 2**50  # 1 PiB: anything above is a typo, not a cache
ENV_PREFIX = "KVTIER__"


def _size(value: Any) -> int:
    if isinstance(value, str | int) and not isinstance(value, bool):
        try:
            n = parse_size(value)
        except ValueError:  # its message quotes the value
            raise ValueError("expected a size such as '32GiB' or a byte count") from None
        if n <= 0:
            raise ValueError("size must be > 0")
        if n > MAX_SIZE:
            raise ValueError("size is absurd (over 1PiB)")
        return n
    raise ValueError("expected a size such as '32GiB'")


Size = Annotated[int, BeforeValidator(_size)]


def _file_mode(value: Any) -> int:
    """Permissions of the files a file tier writes: an octal string ("0640") or an int."""
    if isinstance(value, str) and value.strip():
        digits = value.strip().lower().removeprefix("0o")
        if not digits or digits.strip("01234567"):
            raise ValueError('expected an octal permission string such as "0600"')
        value = int(digits, 8)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError('expected an octal permission string such as "0600"')
    if not 0 <= value <= 0o777:
        raise ValueError('must be a permission from "0000" to "0777"; quote it in YAML')
    if value & 0o600 != 0o600:
        raise ValueError('must let the owner read and write ("0600" at least)')
    if value & 0o111:
        raise ValueError("must not set execute bits (directories get them from read bits)")
    if value & 0o002:
        raise ValueError("must not be world-writable: anyone could plant KV that is served")
    return value


FileMode = Annotated[int, BeforeValidator(_file_mode)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class HostConfig(_Model):
    capacity: Size
    pinned: Literal["auto", "yes", "no"] = "auto"


class FileConfig(_Model):
    path: Path
    capacity: Size
    write: Literal["back", "through"] = "back"
    fsync: bool = True
    touch_interval: float = Field(60.0, ge=0)
    #: Files are owner-only by default; directories kvtier creates get x where r is set.
    mode: FileMode = 0o600
    #: A temp file not written to for this long is an abandoned write (its writer died,
    #: on any node): removed by the start scan and the collector.
    temp_grace_seconds: float = Field(600.0, gt=0)
    #: ``background``: the tier serves at once and its index fills on a thread (lookups
    #: the index cannot answer yet are probed); ``blocking``: start waits for the scan.
    index: Literal["background", "blocking"] = "background"
    #: Objects per second the start scan lists at most (0: no limit): bounds the start-up
    #: metadata load a restart puts on a shared NFS/CephFS (one ``stat`` per object).
    #: Nothing is collected until the scan is done, so keep objects / rate reasonable.
    index_objects_per_second: float = Field(0.0, ge=0)
    #: Threads of the start scan, each listing whole top-level directories (256). More
    #: pay where every ``stat`` is a round trip (CephFS, 100k objects: 920 objects/s with
    #: 4 against 524 with 1); on a local disk the listing is CPU-bound and 1 is fastest.
    index_threads: int = Field(1, ge=1, le=256)
    #: One tick of the walk (an expiry heartbeat, the collector's step every 30 s) lists
    #: the store for at most this long (whole leaf directories), then the next resumes
    #: there: a full pass takes about (listing time of the tier) / this many ticks.
    walk_tick_seconds: float = Field(1.0, gt=0, le=3600)


class S3Config(_Model):
    bucket: str = Field(min_length=3, max_length=63)
    prefix: str = ""
    endpoint_url: str | None = None
    region: str | None = None
    path_style: bool = False
    capacity: Size
    write: Literal["back", "through"] = "back"
    multipart_threshold: Size = 64 * 2**20
    part_size: Size = 16 * 2**20
    max_concurrency: int = Field(4, ge=1, le=64)
    #: Tries per request (backoff between them). A cache gives up fast: seconds, not
    #: minutes, before a restore becomes a recompute.
    max_attempts: int = Field(3, ge=1, le=20)
    connect_timeout: float = Field(1.0, gt=0, le=120)
    read_timeout: float = Field(3.0, gt=0, le=600)
    touch_interval: float = Field(60.0, ge=0)
    #: Which conditional requests the endpoint honours (``kvtier.tiers.s3caps``): ``auto``
    #: probes it at start; ``trusted`` skips the probe and relies on all of them (only for
    #: an endpoint ``kvtier check`` showed honours every one); ``untrusted`` skips it and
    #: uses the HEAD-checked fallbacks everywhere.
    conditionals: Literal["auto", "trusted", "untrusted"] = "auto"
    #: As ``file.index``: ``background`` lists the prefix on a thread after the first page.
    index: Literal["background", "blocking"] = "background"
    #: As ``file.index_objects_per_second`` (a listing page is 1,000 objects).
    index_objects_per_second: float = Field(0.0, ge=0)
    #: As ``file.walk_tick_seconds`` (whole listing pages of 1,000 objects).
    walk_tick_seconds: float = Field(1.0, gt=0, le=3600)


class TierEntry(_Model):
    """One list item: exactly one of ``host``, ``file``, ``s3``."""

    host: HostConfig | None = None
    file: FileConfig | None = None
    s3: S3Config | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> TierEntry:
        kinds = [k for k in ("host", "file", "s3") if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise ValueError(f"each tier is exactly one of host, file, s3; got {kinds or 'none'}")
        return self

    @property
    def spec(self) -> HostConfig | FileConfig | S3Config:
        spec = self.host or self.file or self.s3
        assert spec is not None
        return spec


class IOConfig(_Model):
    threads: int = Field(2, ge=1, le=64)
    max_queued_stores: int = Field(256, ge=1)


class HealthConfig(_Model):
    """The circuit breaker of every lower tier (``kvtier/health.py``)."""

    #: Consecutive failed (or slower than ``slow_seconds``) calls that mark a tier down.
    failures: int = Field(3, ge=1, le=1000)
    #: A call slower than this (plus its bytes at ``min_mib_per_second``) failed; one
    #: still running after that marks the tier down.
    slow_seconds: float = Field(2.0, gt=0, le=600)
    #: The slowest transfer rate a healthy tier may have: a call moving N MiB is allowed
    #: ``slow_seconds + N / min_mib_per_second`` before it counts as slow or stuck, so a
    #: large healthy chunk is not a fault.
    min_mib_per_second: float = Field(20.0, gt=0, le=1_000_000)
    #: How long a down tier is skipped before one trial call.
    cooldown_seconds: float = Field(10.0, ge=0, le=3600)


class RestoreConfig(_Model):
    recompute_threshold_tokens: int | Literal["auto"] = 64
    #: How long a request waits for lower tiers to answer "is it there?" (asked on IO
    #: threads, never on vLLM's scheduler thread) before it is recomputed.
    lookup_timeout_seconds: float = Field(1.0, gt=0, le=600)
    #: A restore whose reads made no progress (no chunk read) for this long, plus one
    #: chunk at ``health.min_mib_per_second``, is abandoned and the request recomputed;
    #: the stuck read's slots are released when it returns.
    load_timeout_seconds: float = Field(2.0, gt=0, le=600)
    #: The shortest a wait on a tier that stopped answering is cut to: a probe or a load
    #: whose read has run this long past its bytes' allowance is given up after the
    #: measured recompute of what it would save, but never before this
    #: (``kvtier.vllm.waitbound``). Raise it where a healthy shared tier's reads take
    #: longer than this on a busy node and restores matter more than the seconds
    #: (never above the two timeouts above, which stay the upper bounds).
    min_wait_seconds: float = Field(0.2, gt=0, le=600)
    #: P/D decode node: how long to wait for the chunks the prefill node announced
    #: (``kv_transfer_params``) to become visible in the shared tier before computing.
    wait_seconds: float = Field(10.0, ge=0, le=600)
    #: ``auto`` (``kvtier.costmodel``): restore only if estimated >= this fraction cheaper
    #: than recomputing the same tokens.
    auto_margin: float = Field(0.1, ge=0, lt=1)
    #: ``auto``: engine steps with prefill work to observe before trusting the estimates;
    #: until then every stored prefix is restored (the fixed-threshold behaviour).
    auto_warmup_steps: int = Field(20, ge=1, le=100_000)

    @model_validator(mode="after")
    def _non_negative(self) -> RestoreConfig:
        t = self.recompute_threshold_tokens
        if isinstance(t, int) and t < 0:
            raise ValueError("recompute_threshold_tokens must be >= 0")
        return self


class RetentionConfig(_Model):
    lease_seconds: float = Field(480.0, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _removed_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and "renew_on_access" in data:
            raise ValueError(
                "renew_on_access was removed: every read renews an object's lease (at most "
                "once per touch_interval), as the lease is its recency; delete the key"
            )
        return data


class EventsConfig(_Model):
    """KV events (``kvtier.vllm.events``; on with vLLM's ``--kv-events-config``)."""

    #: Pieces (chunks, tails, window parts) claimed held at most; beyond, the oldest
    #: claims are withdrawn (BlockRemoved). A 16-block chunk costs about 250 bytes plus
    #: 68-85 bytes a block per medium holding it (the per-block counts): at 1M chunks
    #: held in CPU and STORAGE, about 2.4 GB.
    max_chunks: int = Field(1_000_000, ge=1)
    #: Chunks whose BlockStored payload (tokens, extra keys) is kept until they reach a
    #: tier: 4 bytes a token. A chunk written below after its payload went is published
    #: with empty token_ids.
    max_payload_chunks: int = Field(16_384, ge=1)


class TenancyConfig(_Model):
    """Tenants' salts (``kvtier.tenancy``), for engines behind ``kvtier router --tenants``."""

    #: Touch no KV of a request whose ``cache_salt`` the router did not issue under one of
    #: the tenant secrets: a client that reaches this engine directly, with a salt it
    #: computed or edited, restores nothing and stores nothing. Needs the router's secret.
    require_router_salt: bool = False
    #: The tenant secrets, one a line (as the router's ``--tenant-secret-file``; during a
    #: rotation list the new one and the old one); else ``KVTIER_TENANT_SECRET``.
    secret_file: Path | None = None

    @model_validator(mode="after")
    def _has_secret(self) -> TenancyConfig:
        if self.require_router_salt and self.secret_file is None \
                and not os.environ.get("KVTIER_TENANT_SECRET"):
            raise ValueError("require_router_salt needs the router's tenant secret: set "
                             "tenancy.secret_file or KVTIER_TENANT_SECRET")
        return self


class EncryptionConfig(_Model):
    """KV encrypted at rest in the lower tiers (``kvtier.crypt``): AES-256-GCM, a data key
    per namespace (so per tenant salt) derived from a master key kept outside the tier.
    Every node sharing a tier needs the same setting and keys."""

    #: Seal every object the lower tiers write, and serve only sealed ones.
    enabled: bool = False
    #: Master keys, 64 hex characters each, one a line: the first seals, all open (a
    #: rotation). Else ``KVTIER_ENCRYPTION_KEY`` (``;``-separated).
    key_file: Path | None = None

    @model_validator(mode="after")
    def _has_key(self) -> EncryptionConfig:
        if self.enabled and self.key_file is None \
                and not os.environ.get("KVTIER_ENCRYPTION_KEY"):
            raise ValueError("encryption needs a master key: set encryption.key_file or "
                             "KVTIER_ENCRYPTION_KEY (`openssl rand -hex 32`)")
        return self


class KVTierConfig(_Model):
    chunk_tokens: int = Field(256, ge=16, le=65536)
    copy_backend: Literal["auto", "native", "torch"] = "auto"
    tiers: list[TierEntry] = Field(min_length=1)
    io: IOConfig = IOConfig()
    health: HealthConfig = HealthConfig()
    restore: RestoreConfig = RestoreConfig()
    retention: RetentionConfig = RetentionConfig()
    events: EventsConfig = EventsConfig()
    tenancy: TenancyConfig = TenancyConfig()
    encryption: EncryptionConfig = EncryptionConfig()
    #: On a clean shutdown, seconds spent writing dirty host chunks to the write-back
    #: tiers (most recently used first) before the engine exits. 0 disables the flush.
    shutdown_flush_seconds: float = Field(20.0, ge=0, le=3600)
    #: Write dirty host chunks to the write-back tiers once the engine has been idle this
    #: many seconds (so a stopped server keeps its cache). 0 disables it.
    idle_flush_seconds: float = Field(2.0, ge=0)
    #: The oldest a dirty host chunk may get before it is queued to the write-back tiers,
    #: busy engine or not (the kernel's dirty_expire): a stop at any moment loses at most
    #: this much. 0 disables the bound (only spills, idle and shutdown flushes write).
    max_dirty_seconds: float = Field(10.0, ge=0)
    #: What vLLM's reset_prefix_cache(reset_connector=True) does to kvtier. ``weights``:
    #: the weights may have changed (an RL trainer's weight sync): a new in-memory weights
    #: epoch enters the namespace, so nothing stored before is served again, and the host
    #: tier is emptied, dirty chunks dropped. ``host``: the weights never change in place;
    #: only the host tier is emptied (dirty chunks queued below; the reset answers "not
    #: done" until they are written and dropped) and the lower tiers keep serving.
    reset_cache: Literal["weights", "host"] = "weights"
    #: Also store a request's last partial chunk, down to vLLM's block size (a *tail*),
    #: so a returning turn restores everything up to its last full block, not only its
    #: full chunks. Tails live in the host tier and reach write-back tiers only when
    #: spilled or flushed; a longer save of the same chunk drops them. ``false``: whole
    #: chunks only (a return recomputes up to ``chunk_tokens - 1`` tokens of history).
    partial_tails: bool = True

    @field_validator("tiers")
    @classmethod
    def _host_first(cls, tiers: list[TierEntry]) -> list[TierEntry]:
        if tiers[0].host is None:
            raise ValueError("tiers[0] must be the host tier (it stages every load)")
        if any(t.host is not None for t in tiers[1:]):
            raise ValueError("only one host tier is allowed, as tiers[0]")
        return tiers

    @model_validator(mode="after")
    def _touch_below_lease(self) -> KVTierConfig:
        """Reads renew an object's lease at most once per ``touch_interval``: an interval
        as long as the lease lets expiry cut a conversation that is read all along."""
        for i, entry in enumerate(self.tiers[1:], start=1):
            spec = entry.spec
            touch = getattr(spec, "touch_interval", None)
            if touch is not None and touch >= self.retention.lease_seconds:
                kind = "file" if isinstance(spec, FileConfig) else "s3"
                raise ValueError(
                    f"tiers[{i}].{kind}.touch_interval: {touch:g} s is not below "
                    f"retention.lease_seconds ({self.retention.lease_seconds:g} s); reads "
                    "renew a lease at most once per touch_interval, so a conversation "
                    "read all along could expire: make it well below the lease")
        return self

    @property
    def host(self) -> HostConfig:
        assert self.tiers[0].host is not None
        return self.tiers[0].host


class ConfigError(ValueError):
    """The configuration is invalid. ``str()`` lists every problem, one per line."""


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("function-after[_exactly_one(), TierEntry]",):
            continue
        else:
            out += f".{part}" if out else str(part)
    return out or "(top level)"


_CREDENTIAL_WORDS = ("secret", "access_key", "password", "token", "credential")


def _message(e: ErrorDetails) -> str:
    """What is wrong, never the value: it may be a secret typed in the wrong place."""
    if e["type"] == "extra_forbidden":
        name = str(e["loc"][-1]).lower() if e["loc"] else ""
        if any(word in name for word in _CREDENTIAL_WORDS):
            return "unknown key; credentials never go here (S3 uses the boto3 chain: env, ~/.aws)"
        return "unknown key; remove it or check its spelling"
    msg = e["msg"].removeprefix("Value error, ")
    value = e.get("input")
    if isinstance(value, str) and len(value) >= 4 and value in msg:
        return f"invalid value ({e['type']}; the value is not shown)"
    return msg


def _format(err: ValidationError, source: str) -> ConfigError:
    lines = []
    for e in err.errors(include_url=False, include_context=False):
        loc = _loc(tuple(p for p in e["loc"] if not str(p).startswith("function-")))
        lines.append(f"{loc}: {_message(e)}")
    return ConfigError(f"invalid kvtier config {source}:\n  " + "\n  ".join(lines))


def _set_path(doc: Any, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    cur = doc
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(cur, list):
            try:
                idx = int(part)
                if last:
                    cur[idx] = value
                else:
                    cur = cur[idx]
            except (ValueError, IndexError):
                raise ConfigError(f"override {dotted!r}: no list item {part!r}") from None
        elif isinstance(cur, dict):
            if last:
                cur[part] = value
            else:
                cur = cur.setdefault(part, {})
        else:
            raise ConfigError(f"override {dotted!r}: {'.'.join(parts[:i])} is not a mapping")


def env_overrides(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``KVTIER__RESTORE__RECOMPUTE_THRESHOLD_TOKENS=32`` -> ``{"restore....": 32}``."""
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for name, raw in env.items():
        if name.startswith(ENV_PREFIX) and len(name) > len(ENV_PREFIX):
            dotted = name[len(ENV_PREFIX) :].lower().replace("__", ".")
            try:
                out[dotted] = yaml.safe_load(raw)
            except yaml.YAMLError:
                raise ConfigError(f"{name}: not a valid YAML value") from None
    return out


def parse_config(
    doc: Any,
    *,
    source: str = "<dict>",
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> KVTierConfig:
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise ConfigError(f"invalid kvtier config {source}: the top level must be a mapping")
    merged = {**env_overrides(environ), **(overrides or {})}
    for dotted, value in merged.items():
        _set_path(doc, dotted, value)
    try:
        return KVTierConfig.model_validate(doc)
    except ValidationError as e:
        raise _format(e, source) from None


def load_config(
    path: str | os.PathLike[str],
    *,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> KVTierConfig:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read kvtier config {p}: {e.strerror}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:  # str(e) quotes the offending line: it may hold a secret
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or "syntax error"
        raise ConfigError(f"kvtier config {p} is not valid YAML{where}: {problem}") from None
    return parse_config(doc, source=str(p), overrides=overrides, environ=environ)
