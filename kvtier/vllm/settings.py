"""``kv_connector_extra_config``: where the connector finds its YAML and overrides.

Keys (all others are an error naming the key):

* ``config``: path to the kvtier YAML (required).
* ``overrides``: ``{"dotted.key": value}`` applied to the YAML before validation.
* ``model_fingerprint``: use this string instead of hashing the model's config/weights.
* ``role``: ``both`` (default; one engine, eviction tiering), or ``prefill`` / ``decode``
  for P/D disaggregation. Both P/D roles need a write-through lower tier that the other
  node reaches (the KV moves through it), and say so at start if there is none. Unset,
  it follows vLLM's ``kv_role``: ``kv_producer`` is ``prefill``, ``kv_consumer`` is
  ``decode``, ``kv_both`` is ``both``.
* ``load`` / ``save`` (booleans): whether this engine restores KV from kvtier and stores
  its KV there. Unset, they follow ``kv_role``: a ``kv_producer`` never loads, a
  ``kv_consumer`` never saves, ``kv_both`` does both. (A request's own
  ``kv_transfer_params.kvtier`` ``load: false`` / ``save: false`` still apply.)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from os import PathLike
from typing import Any

from kvtier.config import ConfigError, KVTierConfig, load_config

ALLOWED = {"config", "overrides", "model_fingerprint", "role", "load", "save"}
ROLES = ("both", "prefill", "decode")
#: vLLM's ``kv_role`` -> kvtier's role, and whether the engine loads and saves by default
KV_ROLES = {"kv_both": ("both", True, True), "kv_producer": ("prefill", False, True),
            "kv_consumer": ("decode", True, False)}


@dataclass(frozen=True)
class ConnectorSettings:
    config: KVTierConfig
    model_fingerprint: str | None
    role: str = "both"
    #: this engine restores KV from kvtier / stores its KV there
    load: bool = True
    save: bool = True


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


def parse_extra_config(extra: Mapping[str, Any] | None,
                       kv_role: str | None = None) -> ConnectorSettings:
    """``kv_connector_extra_config`` validated, with vLLM's ``kv_role`` (``KV_ROLES``)
    giving the defaults of ``role``, ``load`` and ``save``. Raises ``ConfigError`` naming
    the key."""
    extra = dict(extra or {})
    if kv_role is not None and kv_role not in KV_ROLES:
        raise ConfigError(f"kv_role {kv_role!r} is not one of {sorted(KV_ROLES)}")
    default_role, default_load, default_save = KV_ROLES[kv_role or "kv_both"]
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
    role = extra.get("role", default_role)
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
    flags = {}
    for key, default in (("load", default_load), ("save", default_save)):
        value = extra.get(key, default)
        if not isinstance(value, bool):
            raise ConfigError(f"kv_connector_extra_config.{key}: must be true or false, "
                              f"not {value!r}")
        flags[key] = value
    return ConnectorSettings(cfg, fp, role, flags["load"], flags["save"])
