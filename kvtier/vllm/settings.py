"""``kv_connector_extra_config``: where the connector finds its YAML and overrides.

Keys (all others are an error naming the key):

* ``config``: path to the kvtier YAML (required).
* ``overrides``: ``{"dotted.key": value}`` applied to the YAML before validation.
* ``model_fingerprint``: use this string instead of hashing the model's config/weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.config import ConfigError, KVTierConfig, load_config

ALLOWED = {"config", "overrides", "model_fingerprint"}


@dataclass(frozen=True)
class ConnectorSettings:
    config: KVTierConfig
    model_fingerprint: str | None


def parse_extra_config(extra: Mapping[str, Any] | None) -> ConnectorSettings:
    extra = dict(extra or {})
    unknown = sorted(set(extra) - ALLOWED)
    if unknown:
        raise ConfigError(
            f"kv_connector_extra_config: unknown key(s) {unknown}; allowed: {sorted(ALLOWED)}"
        )
    path = extra.get("config")
    if not isinstance(path, str) or not path:
        raise ConfigError(
            "kv_connector_extra_config.config: required, the path of a kvtier YAML "
            "(e.g. configs/local.yaml)"
        )
    overrides = extra.get("overrides") or {}
    if not isinstance(overrides, dict):
        raise ConfigError("kv_connector_extra_config.overrides: must be a mapping")
    fp = extra.get("model_fingerprint")
    if fp is not None and not isinstance(fp, str):
        raise ConfigError("kv_connector_extra_config.model_fingerprint: must be a string")
    return ConnectorSettings(load_config(path, overrides=overrides), fp)
