"""Each benchmark runs end to end at tiny sizes (numbers are not checked, shape is)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchrun import run_benchmark


def test_tiers_benchmark_smoke(tmp_path: Path) -> None:
    out = tmp_path / "tiers.json"
    text = run_benchmark("benchmarks/tiers.py", "--total", "8MiB", "--chunk", "1MiB", "--reps", "1",
                "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert {(r["path"], r["op"]) for r in rows} == {
        ("host", "put"), ("host", "get"), ("file", "write"), ("file", "cold read"),
        ("s3", "put"), ("s3", "get"), ("sealed", "write"), ("sealed", "warm read"),
        ("sealed", "cipher")}
    assert "ratio" in text


@pytest.mark.vllm
def test_restore_vs_recompute_smoke(tmp_path: Path, models_dir: Path) -> None:
    text = run_benchmark("benchmarks/restore_vs_recompute.py", "--preset", "tiny", "--lengths",
                "512,1024", "--tiers", "host,file", "--out-dir", str(tmp_path),
                "--cache-dir", str(models_dir))
    rows = [json.loads(line) for line in (tmp_path / "restore_vs_recompute.jsonl").open()]
    assert [r["tokens"] for r in rows] == [512, 1024]
    for r in rows:
        # All but the last block: vLLM always computes at least one token itself.
        assert r["host_restored"] == {"host": r["tokens"] - 128}
        assert r["file_restored"] == {"file1": r["tokens"] - 128}
    assert (tmp_path / "restore_vs_recompute.png").stat().st_size > 0
    assert "cold/host" in text


def test_router_pricing_benchmark_smoke(tmp_path: Path) -> None:
    out = tmp_path / "rp.json"
    text = run_benchmark("benchmarks/router_pricing.py", "--conversations", "20",
                         "--chunks", "6", "--out", str(out))
    rows = {r["way"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"index", "confirmed", "after shortfall"}
    assert rows["after shortfall"]["precision"] == 1.0  # every chunk checked
    assert rows["index"]["precision"] < rows["confirmed"]["precision"]
    assert "precision" in text
