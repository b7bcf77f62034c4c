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


# -- errors never quote a value (a misplaced secret must not reach vLLM's log) -----------
SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYzSECRETKEY"


def _with_file(**file: object) -> dict[str, object]:
    return {"tiers": [{"host": {"capacity": "1GiB"}},
                      {"file": {"path": "/x", "capacity": "1GiB", **file}}]}


@pytest.mark.parametrize(("doc", "path"), [
    (_with_file(aws_secret_access_key=SECRET),
     "tiers[1].file.aws_secret_access_key: unknown key; credentials never go here"),
    ({**BASE, "aws_secret_access_key": SECRET}, "aws_secret_access_key: unknown key"),
    (_with_file(capacity=SECRET), "tiers[1].file.capacity: expected a size"),
    (_with_file(fsync=SECRET), "tiers[1].file.fsync: "),
    (_with_file(write=SECRET), "tiers[1].file.write: "),
    (_with_file(touch_interval=SECRET), "tiers[1].file.touch_interval: "),
    (_with_file(mode=SECRET), "tiers[1].file.mode: expected an octal permission"),
    ({**BASE, "chunk_tokens": SECRET}, "chunk_tokens: Input should be a valid integer"),
    ({**BASE, "copy_backend": SECRET}, "copy_backend: "),
    ({"tiers": [{"host": {"capacity": "1GiB", "pinned": SECRET}}]}, "tiers[0].host.pinned: "),
    ({**BASE, "restore": {"recompute_threshold_tokens": SECRET}},
     "restore.recompute_threshold_tokens"),
    ({"tiers": [{"host": {"capacity": "1GiB"}},
                {"s3": {"bucket": SECRET * 2, "capacity": "1GiB"}}]}, "tiers[1].s3.bucket: "),
    ({"tiers": [{"host": {"capacity": "1GiB"}},
                {"s3": {"bucket": "b-1", "capacity": "1GiB", "region": {"k": SECRET}}}]},
     "tiers[1].s3.region: "),
])
def test_errors_name_the_field_but_never_the_value(doc: dict[str, object], path: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(doc, environ={})
    assert path in str(e.value)
    assert SECRET not in str(e.value)
    assert "wJalr" not in str(e.value)


def test_yaml_and_env_errors_never_quote_the_text(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"tiers:\n  - host: {{capacity: 1GiB, key: {SECRET}\n")
    with pytest.raises(ConfigError, match=r"not valid YAML at line \d+, column \d+") as e:
        load_config(bad)
    assert SECRET not in str(e.value)
    with pytest.raises(ConfigError, match="KVTIER__TIERS__1__FILE__PATH") as e:
        parse_config(BASE, environ={"KVTIER__TIERS__1__FILE__PATH": f"[{SECRET}"})
    assert SECRET not in str(e.value)


# -- file tier keys -----------------------------------------------------------------------
@pytest.mark.parametrize(("given", "mode"), [
    (None, 0o600), ("0640", 0o640), ("0o660", 0o660), ("600", 0o600), (0o644, 0o644),
])
def test_file_mode_is_octal_and_owner_only_by_default(given: object, mode: int) -> None:
    cfg = parse_config(_with_file() if given is None else _with_file(mode=given), environ={})
    spec = cfg.tiers[1].file
    assert spec is not None and spec.mode == mode


def test_file_mode_unquoted_in_yaml_is_octal(tmp_path: Path) -> None:
    p = tmp_path / "k.yaml"
    p.write_text("tiers:\n  - host: {capacity: 1GiB}\n"
                 "  - file: {path: /x, capacity: 1GiB, mode: 0640}\n")
    spec = load_config(p, environ={}).tiers[1].file
    assert spec is not None and spec.mode == 0o640


@pytest.mark.parametrize(("given", "message"), [
    ("rw-r-----", "octal permission string"),
    ("0o", "octal permission string"),
    (600, "from \"0000\" to \"0777\""),  # unquoted decimal 600 is 0o1130
    ("0400", "owner read and write"),
    ("0700", "execute bits"),
    ("0666", "world-writable"),
    (True, "octal permission string"),
    (1.5, "octal permission string"),
])
def test_bad_file_modes_name_the_field(given: object, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(_with_file(mode=given), environ={})
    assert "tiers[1].file.mode: " in str(e.value)
    assert message in str(e.value)


def test_temp_grace_is_positive() -> None:
    spec = parse_config(_with_file(), environ={}).tiers[1].file
    assert spec is not None and spec.temp_grace_seconds == 600
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.file\.temp_grace_seconds: "):
        parse_config(_with_file(temp_grace_seconds=0), environ={})


def test_the_start_scan_rate_defaults_to_no_limit_and_is_not_negative() -> None:
    spec = parse_config(_with_file(), environ={}).tiers[1].file
    assert spec is not None and spec.index_objects_per_second == 0
    spec = parse_config(_with_file(index_objects_per_second=500), environ={}).tiers[1].file
    assert spec is not None and spec.index_objects_per_second == 500
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.file\.index_objects_per_second: "):
        parse_config(_with_file(index_objects_per_second=-1), environ={})


def test_the_start_scan_threads_default_to_one_and_are_at_least_one() -> None:
    spec = parse_config(_with_file(), environ={}).tiers[1].file
    assert spec is not None and spec.index_threads == 1
    spec = parse_config(_with_file(index_threads=4), environ={}).tiers[1].file
    assert spec is not None and spec.index_threads == 4
    for bad in (0, -2, 1.5, "many"):
        with pytest.raises(ConfigError, match=r"tiers\[1\]\.file\.index_threads: "):
            parse_config(_with_file(index_threads=bad), environ={})


def test_renew_on_access_is_refused_with_the_reason() -> None:
    for value in (True, False):
        with pytest.raises(ConfigError, match=r"retention: renew_on_access was removed: every "
                                              r"read renews"):
            parse_config({**BASE, "retention": {"renew_on_access": value}}, environ={})
    assert parse_config({**BASE, "retention": {"lease_seconds": 60}}, environ={})


def test_the_shipped_pd_config_shares_a_directory_outside_tmp() -> None:
    spec = load_config(CONFIGS / "pd-shared.yaml", environ={}).tiers[1].file
    assert spec is not None and spec.write == "through"
    assert spec.path.is_absolute()
    assert not spec.path.is_relative_to("/tmp") and not spec.path.is_relative_to("/var/tmp")


def test_pinned_yes_fails_at_start_when_memory_cannot_be_page_locked() -> None:
    """No CUDA here: ``pinned: yes`` must not silently run pageable (``auto`` does)."""
    import torch

    from kvtier.build import build_host
    from kvtier.config import HostConfig
    from kvtier.tiers.base import TierError

    if torch.cuda.is_available():
        pytest.skip("page-locking works on this machine")
    with pytest.raises(TierError, match=r"tiers\[0\]\.host\.pinned: yes.*pinned: auto"):
        build_host(HostConfig(capacity=1 << 20, pinned="yes"), 4096)
    assert not build_host(HostConfig(capacity=1 << 20, pinned="auto"), 4096).pool.pinned


def _s3(**kw: object) -> dict[str, object]:
    return {"tiers": [{"host": {"capacity": "1GiB"}},
                      {"s3": {"bucket": "b-1", "capacity": "1GiB", **kw}}]}


def test_s3_conditionals_defaults_to_auto_and_takes_the_modes() -> None:
    s3 = parse_config(_s3(), environ={}).tiers[1].s3
    assert s3 is not None and s3.conditionals == "auto"
    for mode in ("auto", "trusted", "untrusted"):
        s3 = parse_config(_s3(conditionals=mode), environ={}).tiers[1].s3
        assert s3 is not None and s3.conditionals == mode


@pytest.mark.parametrize("bad", [SECRET, "yes", True, 1])
def test_a_bad_s3_conditionals_names_the_choices_never_the_value(bad: object) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(_s3(conditionals=bad), environ={})
    msg = str(e.value)
    assert "tiers[1].s3.conditionals: Input should be 'auto', 'trusted' or 'untrusted'" in msg
    assert SECRET not in msg and "wJalr" not in msg


def test_a_touch_interval_as_long_as_the_lease_is_refused() -> None:
    """Reads renew a lease at most once per ``touch_interval``: one as long as the lease
    lets a conversation read every minute lose its objects to expiry (issue 32)."""
    doc = {**_with_file(touch_interval=600), "retention": {"lease_seconds": 480}}
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.file\.touch_interval: 600 s is not "
                                          r"below retention\.lease_seconds"):
        parse_config(doc, environ={})
    assert parse_config({**_with_file(touch_interval=60), "retention": {"lease_seconds": 480}},
                        environ={})
