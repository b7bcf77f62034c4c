"""Each benchmark runs end to end at tiny sizes (numbers are not checked, shape is)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> str:
    r = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def test_tiers_benchmark_smoke(tmp_path: Path) -> None:
    out = tmp_path / "tiers.json"
    text = _run("benchmarks/tiers.py", "--total", "8MiB", "--chunk", "1MiB", "--reps", "1",
                "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert {(r["path"], r["op"]) for r in rows} == {
        ("host", "put"), ("host", "get"), ("file", "write"), ("file", "cold read"),
        ("s3", "put"), ("s3", "get")}
    assert "ratio" in text


@pytest.mark.vllm
def test_restore_vs_recompute_smoke(tmp_path: Path) -> None:
    text = _run("benchmarks/restore_vs_recompute.py", "--preset", "tiny", "--lengths",
                "512,1024", "--tiers", "host,file", "--out-dir", str(tmp_path),
                "--cache-dir", str(tmp_path / "models"))
    rows = [json.loads(line) for line in (tmp_path / "restore_vs_recompute.jsonl").open()]
    assert [r["tokens"] for r in rows] == [512, 1024]
    for r in rows:
        # All but the last block: vLLM always computes at least one token itself.
        assert r["host_restored"] == {"host": r["tokens"] - 128}
        assert r["file_restored"] == {"file1": r["tokens"] - 128}
    assert (tmp_path / "restore_vs_recompute.png").stat().st_size > 0
    assert "cold/host" in text
