"""``kv_connector_extra_config``: where the connector finds its YAML and overrides.

Keys (all others are an error naming the key):

* ``config``: path to the kvtier YAML (required).
* ``overrides``: ``{"dotted.key": value}`` applied to the YAML before validation.
* ``model_fingerprint``: use this string instead of hashing the model's config/weights.
* ``role``: ``both`` (default; one engine, eviction tiering), or ``prefill`` / ``decode``
  for P/D disaggregation. Both P/D roles need a write-through lower tier that the other
  node reaches (the KV moves through it), and say so at start if there is none.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from os import PathLike
from typing import Any

from kvtier.config import ConfigError, KVTierConfig, load_config

ALLOWED = {"config", "overrides", "model_fingerprint", "role"}
ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True)
class ConnectorSettings:
    config: KVTierConfig
    model_fingerprint: str | None
    role: str = "both"


def kv_transfer_config(
    config: str | PathLike[str], *, role: str = "both", **extra: Any
) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` for kvtier with the YAML at ``config``.

    ``--kv-transfer-config`` takes its JSON. ``extra`` adds ``kv_connector_extra_config``
    keys (``overrides``, ``model_fingerprint``).
    """
    more: dict[str, Any] = {"config": str(config), **extra}
    if role != "both":
        more["role"] = role
    return {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",  # vLLM's default, "fail", aborts the request
        "kv_connector_extra_config": more,
    }


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
    role = extra.get("role", "both")
    if role not in ROLES:
        raise ConfigError(
            f"kv_connector_extra_config.role: {role!r} is not one of {list(ROLES)}"
        )
    cfg = load_config(path, overrides=overrides)
    if role != "both" and not any(
        t.spec.write == "through" for t in cfg.tiers[1:]  # type: ignore[union-attr]
    ):
        raise ConfigError(
            f"kv_connector_extra_config.role: {role!r} moves KV through a shared tier, but "
            f"{path} has no lower tier with 'write: through'; add a file or s3 tier that "
            "both nodes reach, with write: through (see configs/pd-shared.yaml)"
        )
    return ConnectorSettings(cfg, fp, role)
