"""kv_connector_extra_config and geometry checks, without starting an engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.config import ConfigError
from kvtier.tiers.base import TierError
from kvtier.vllm.geometry import Geometry
from kvtier.vllm.settings import parse_extra_config


def _yaml(tmp: Path) -> str:
    p = tmp / "k.yaml"
    p.write_text("tiers:\n  - host: {capacity: 64MiB}\n")
    return str(p)


def test_valid_extra_config(tmp_path: Path) -> None:
    s = parse_extra_config({"config": _yaml(tmp_path), "overrides": {"chunk_tokens": 512},
                            "model_fingerprint": "abc"})
    assert s.config.chunk_tokens == 512 and s.model_fingerprint == "abc"


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({}, "kv_connector_extra_config.config: required"),
        ({"colour": "red"}, "unknown key(s) ['colour']"),
        ({"overrides": {"tiers.0.host.capacity": "lots"}}, "tiers[0].host.capacity"),
        ({"overrides": "x"}, "overrides: must be a mapping"),
        ({"role": "router"}, "role: 'router' is not one of"),
        ({"role": "decode"}, "no lower tier with 'write: through'"),
    ],
)
def test_bad_extra_config_names_the_field(tmp_path: Path, extra: dict[str, object],
                                          needle: str) -> None:
    if extra and "config" not in extra and "colour" not in extra:
        extra = {"config": _yaml(tmp_path), **extra}
    with pytest.raises(ConfigError) as e:
        parse_extra_config(extra)
    assert needle in str(e.value)


def test_pd_roles_need_a_write_through_shared_tier(tmp_path: Path) -> None:
    p = tmp_path / "pd.yaml"
    p.write_text(f"tiers:\n  - host: {{capacity: 64MiB}}\n"
                 f"  - file: {{path: {tmp_path / 'shared'}, capacity: 1GiB, write: through}}\n")
    for role in ("prefill", "decode", "both"):
        assert parse_extra_config({"config": str(p), "role": role}).role == role


def test_chunk_tokens_must_be_a_multiple_of_block_size() -> None:
    g = Geometry(2, 2, 64, 128, 65536, "float32")
    assert g.blocks_per_chunk(256) == 2
    with pytest.raises(TierError, match="chunk_tokens: 200 is not a multiple"):
        g.blocks_per_chunk(200)


def test_shipped_vllm_configs_are_valid(monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    files = sorted((root / "configs").glob("vllm-*.json")) + sorted(
        (root / "configs").glob("pd-*.json")
    )
    assert files
    for f in files:
        doc = json.loads(f.read_text())
        assert doc["kv_connector_module_path"] == "kvtier.vllm"
        parse_extra_config(doc["kv_connector_extra_config"])


def test_model_fingerprint_tells_checkpoints_apart(tmp_path: Path) -> None:
    """Same name and config, different weights: different fingerprint, so no shared KV."""
    from types import SimpleNamespace

    from kvtier.testing.models import build_tiny_llama
    from kvtier.vllm.geometry import model_fingerprint

    a = build_tiny_llama(tmp_path / "a", seed=1)
    b = build_tiny_llama(tmp_path / "b", seed=2)

    def fp(path: Path) -> str:
        return model_fingerprint(SimpleNamespace(model=str(path), hf_config=None, revision=None))

    assert fp(a) == fp(a)
    assert fp(a) != fp(b)


def test_kv_role_means_what_it_says(tmp_path: Path) -> None:
    """vLLM's ``kv_role`` sets kvtier's defaults: a producer never loads, a consumer
    never saves (each can be turned back on), ``kv_both`` does both; an explicit
    ``role`` wins; a bad ``load``/``save`` names the key."""
    p = tmp_path / "pd.yaml"
    p.write_text(f"tiers:\n  - host: {{capacity: 64MiB}}\n"
                 f"  - file: {{path: {tmp_path / 'shared'}, capacity: 1GiB, write: through}}\n")
    both = parse_extra_config({"config": str(p)}, "kv_both")
    assert (both.role, both.load, both.save) == ("both", True, True)
    prod = parse_extra_config({"config": str(p)}, "kv_producer")
    assert (prod.role, prod.load, prod.save) == ("prefill", False, True)
    cons = parse_extra_config({"config": str(p)}, "kv_consumer")
    assert (cons.role, cons.load, cons.save) == ("decode", True, False)
    again = parse_extra_config({"config": str(p), "save": True, "role": "both"}, "kv_consumer")
    assert (again.role, again.load, again.save) == ("both", True, True)
    assert parse_extra_config({"config": str(p)}).load  # no kv_role: kv_both
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.load: must be true"):
        parse_extra_config({"config": str(p), "load": "yes"}, "kv_both")
