"""The docs against the code: generated pages current, every key, series and flag
documented, the README short, the examples valid, and the mkdocs site building."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from kvtier import cli, docgen, metrics
from kvtier.config import KVTierConfig, TierEntry, env_overrides, parse_config
from kvtier.vllm.settings import kv_transfer_config

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"


def _leaf_keys(model: type[BaseModel], prefix: str) -> Iterator[str]:
    """Every scalar key of ``model`` as a dotted path, tier entries as ``tiers[i].file``."""
    for name, info in model.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from _leaf_keys(ann, path)
            continue
        if name == "tiers":
            yield path
            for kind, field in TierEntry.model_fields.items():
                sub = next(a for a in (field.annotation.__args__)  # type: ignore[union-attr]
                           if isinstance(a, type) and issubclass(a, BaseModel))
                index = "0" if kind == "host" else "i"
                yield from _leaf_keys(sub, f"tiers[{index}].{kind}")
            continue
        yield path


def _yaml_blocks(text: str) -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", text, flags=re.S)


def test_generated_pages_match_the_code() -> None:
    stale = docgen.drifted(DOCS)
    assert not stale, f"{stale} are stale: run {docgen.REGENERATE}"


def test_every_config_key_is_documented() -> None:
    page = (DOCS / "configuration.md").read_text()
    keys = list(_leaf_keys(KVTierConfig, ""))
    assert len(keys) > 40
    missing = [k for k in keys if f"`{k}`" not in page]
    assert not missing
    assert set(keys) == set(docgen.config_paths())


def test_every_config_key_has_a_description_and_an_env_var() -> None:
    for section in docgen.config_sections():
        for key in section.keys:
            assert key.doc, f"{key.path}: no description (add a #: comment or _FIELD_DOCS)"
            env = key.env.replace("<i>", "1")
            dotted = re.sub(r"\[(\w)\]", lambda m: "." + m.group(1).replace("i", "1"),
                            key.path)
            assert env_overrides({env: "x"}) == {dotted: "x"}, key.path


def test_every_metric_is_documented() -> None:
    page = (DOCS / "metrics.md").read_text()
    defined = [v for v in vars(metrics).values() if isinstance(v, metrics.Series)]
    assert {s.name for s in defined} == set(metrics.SERIES)
    missing = [name for name in metrics.SERIES if f"`{name}`" not in page]
    assert not missing
    for row in docgen.router_metrics():
        assert f"`{row.name}`" in page


def test_every_cli_flag_is_documented() -> None:
    page = (DOCS / "cli.md").read_text()
    parser = cli._parser()
    parsers: list[argparse.ArgumentParser] = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            parsers.extend(action.choices.values())
            for name in action.choices:
                assert f"## `kvtier {name}`" in page
    flags = {s for p in parsers for a in p._actions for s in a.option_strings} - {"-h", "--help"}
    assert "--pd-max-direct-tokens" in flags
    missing = [f for f in sorted(flags) if f"`{f}" not in page and f", {f}" not in page]
    assert not missing


def test_no_fallback_description_is_stale() -> None:
    assert docgen.stale_fallbacks() == []


def test_check_names_a_drifted_page_and_the_command(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert docgen.main(["--write", str(tmp_path)]) == 0
    assert docgen.main(["--check", str(tmp_path)]) == 0
    page = tmp_path / "metrics.md"
    page.write_text(page.read_text() + "edited by hand\n")
    capsys.readouterr()
    assert docgen.main(["--check", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert str(page) in err and "python -m kvtier.docgen --write" in err
    assert "configuration.md" not in err


def test_readme_is_short() -> None:
    lines = README.read_text().count("\n")
    assert lines <= 200, f"README.md has {lines} lines; move detail into docs/"


def test_readme_links_resolve() -> None:
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text()):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), target


def test_example_configs_validate() -> None:
    docs = [README, DOCS / "configuration.md", DOCS / "pd.md"]
    blocks = [b for path in docs for b in _yaml_blocks(path.read_text()) if "tiers:" in b]
    assert blocks
    blocks.append((ROOT / "deploy" / "kvtier.yaml").read_text())
    manifests = list(yaml.safe_load_all((ROOT / "deploy" / "k8s" / "kvtier-vllm.yaml")
                                        .read_text()))
    config_map = next(m for m in manifests if m["kind"] == "ConfigMap")
    blocks.append(config_map["data"]["kvtier.yaml"])
    for block in blocks:
        parse_config(yaml.safe_load(block), environ={})
    expected = kv_transfer_config("/etc/kvtier/kvtier.yaml")
    assert json.loads(config_map["data"]["kv-transfer-config.json"]) == expected
    assert json.loads((ROOT / "deploy" / "kv-transfer-config.json").read_text()) == expected


def test_readme_connector_json_is_what_the_helper_builds() -> None:
    text = README.read_text()
    block = re.search(r"```json\n(.*?)```", text, flags=re.S)
    assert block is not None
    expected: dict[str, Any] = kv_transfer_config("configs/local.yaml")
    assert json.loads(block.group(1)) == expected
    assert json.loads((ROOT / "configs" / "vllm-local.json").read_text()) == expected


@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
    reason="mkdocs and mkdocs-material are not installed (they come with the dev extras: "
    "make install)")
def test_mkdocs_site_builds_strict(tmp_path: Path) -> None:
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    assert (site / "configuration" / "index.html").is_file()
    shutil.rmtree(site)
