"""Config: strict validation with field paths, sizes, overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.config import ConfigError, load_config, parse_config
from kvtier.sizes import format_size, parse_size

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
BASE = {"tiers": [{"host": {"capacity": "1GiB"}}]}


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_shipped_configs_are_valid(name: str) -> None:
    load_config(CONFIGS / name)


def test_sizes() -> None:
    assert parse_size("32GiB") == 32 * 2**30
    assert parse_size("1.5MB") == 1_500_000
    assert parse_size(4096) == 4096
    assert format_size(3 * 2**30) == "3.0GiB"
    for bad in ["-1GiB", "12 parsecs", "", "GiB"]:
        with pytest.raises(ValueError):
            parse_size(bad)


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"tiers": [{"host": {"capacity": "1GiB"}}, {"s3": {"capacity": "1GiB"}}]},
         "tiers[1].s3.bucket: Field required"),
        ({"tiers": [{"host": {"capacity": "1GiB", "colour": "red"}}]},
         "tiers[0].host.colour: unknown key"),
        ({"tiers": [{"host": {"capacity": "-5GiB"}}]}, "tiers[0].host.capacity"),
        ({"tiers": [{"host": {"capacity": "9000PiB"}}]}, "tiers[0].host.capacity"),
        ({"tiers": [{"host": {"capacity": "5000TiB"}}]}, "absurd"),
        ({"tiers": [{"host": {"capacity": "1GiB"}}], "chunk_tokens": "many"},
         "chunk_tokens: Input should be a valid integer"),
        ({"tiers": [{"file": {"path": "/x", "capacity": "1GiB"}}]},
         "tiers[0] must be the host tier"),
        ({"tiers": []}, "tiers: List should have at least 1 item"),
        ({"tiers": [{"host": {"capacity": "1GiB"}}], "restore": {"recompute_threshold_tokens": -1}},
         "recompute_threshold_tokens must be >= 0"),
        ({"tiers": [{"host": {"capacity": "1GiB"}, "file": {"path": "/x", "capacity": 1}}]},
         "exactly one of host, file, s3"),
    ],
)
def test_bad_configs_name_the_field(doc: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(doc)
    assert message in str(e.value)


def test_malformed_yaml_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers: [host: {capacity: 1GiB\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.yaml")


def test_env_and_dotted_overrides_are_validated() -> None:
    env = {
        "KVTIER__RESTORE__RECOMPUTE_THRESHOLD_TOKENS": "32",
        "KVTIER__TIERS__0__HOST__CAPACITY": "2GiB",
    }
    cfg = parse_config({"tiers": [{"host": {"capacity": "1GiB"}}]}, environ=env)
    assert cfg.restore.recompute_threshold_tokens == 32
    assert cfg.host.capacity == 2 * 2**30
    cfg = parse_config({"tiers": [{"host": {"capacity": "1GiB"}}]},
                       overrides={"chunk_tokens": 512}, environ={})
    assert cfg.chunk_tokens == 512
    with pytest.raises(ConfigError, match="chunk_tokens"):
        parse_config({"tiers": [{"host": {"capacity": "1GiB"}}]},
                     overrides={"chunk_tokens": "x"}, environ={})
    with pytest.raises(ConfigError, match="no list item"):
        parse_config({"tiers": [{"host": {"capacity": "1GiB"}}]},
                     overrides={"tiers.5.host.capacity": 1}, environ={})
