"""The one YAML file that configures kvtier, parsed into frozen, validated models.

Invariants:

* Unknown keys are errors, everywhere (``extra="forbid"``).
* Every error names the field path and the bad value, e.g.
  ``tiers[1].s3.bucket: Field required``, and the whole list is reported at once.
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

from kvtier.sizes import parse_size

MAX_SIZE = 2**50  # 1 PiB: anything above is a typo, not a cache
ENV_PREFIX = "KVTIER__"


def _size(value: Any) -> int:
    if isinstance(value, str | int) and not isinstance(value, bool):
        n = parse_size(value)
        if n <= 0:
            raise ValueError(f"size must be > 0, got {value!r}")
        if n > MAX_SIZE:
            raise ValueError(f"size {value!r} is absurd (over 1PiB)")
        return n
    raise ValueError(f"expected a size such as '32GiB', got {value!r}")


Size = Annotated[int, BeforeValidator(_size)]


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
    max_attempts: int = Field(5, ge=1, le=20)
    touch_interval: float = Field(60.0, ge=0)


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


class RestoreConfig(_Model):
    recompute_threshold_tokens: int | Literal["auto"] = 64
    #: P/D decode node: how long to wait for the chunks the prefill node announced
    #: (``kv_transfer_params``) to become visible in the shared tier before computing.
    wait_seconds: float = Field(10.0, ge=0, le=600)

    @model_validator(mode="after")
    def _non_negative(self) -> RestoreConfig:
        t = self.recompute_threshold_tokens
        if isinstance(t, int) and t < 0:
            raise ValueError(f"recompute_threshold_tokens must be >= 0, got {t}")
        return self


class RetentionConfig(_Model):
    lease_seconds: float = Field(480.0, gt=0)
    renew_on_access: bool = True


class KVTierConfig(_Model):
    chunk_tokens: int = Field(256, ge=16, le=65536)
    copy_backend: Literal["auto", "native", "torch"] = "auto"
    tiers: list[TierEntry] = Field(min_length=1)
    io: IOConfig = IOConfig()
    restore: RestoreConfig = RestoreConfig()
    retention: RetentionConfig = RetentionConfig()

    @field_validator("tiers")
    @classmethod
    def _host_first(cls, tiers: list[TierEntry]) -> list[TierEntry]:
        if tiers[0].host is None:
            raise ValueError("tiers[0] must be the host tier (it stages every load)")
        if any(t.host is not None for t in tiers[1:]):
            raise ValueError("only one host tier is allowed, as tiers[0]")
        return tiers

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


def _format(err: ValidationError, source: str) -> ConfigError:
    lines = []
    for e in err.errors():
        loc = _loc(tuple(p for p in e["loc"] if not str(p).startswith("function-")))
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key; remove it or check its spelling"
        value = e.get("input")
        hide = e["type"] == "missing" or isinstance(value, dict | list) or repr(value) in msg
        got = "" if hide else f" (got {value!r})"
        lines.append(f"{loc}: {msg}{got}")
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
            out[dotted] = yaml.safe_load(raw)
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
    except yaml.YAMLError as e:
        raise ConfigError(f"kvtier config {p} is not valid YAML: {e}") from None
    return parse_config(doc, source=str(p), overrides=overrides, environ=environ)
