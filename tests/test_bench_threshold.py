"""benchmarks/threshold.py --smoke runs end to end (one tiny engine, ~60 s on 2 cores).

Numbers are not checked, the shape is: what ``auto`` decides depends on the machine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchrun import run_benchmark


@pytest.mark.vllm
def test_threshold_benchmark_smoke(tmp_path: Path, models_dir: Path) -> None:
    stdout = run_benchmark("benchmarks/threshold.py", "--smoke", "--out-dir", str(tmp_path),
                           "--cache-dir", str(models_dir), timeout=600)
    report = json.loads((tmp_path / "threshold.json").read_text())
    rows = report["rows"]
    assert [(row["tokens"], row["tier"]) for row in rows] == [
        (512, "host"), (512, "file"), (1024, "host"), (1024, "file")]
    for row in rows:
        assert row["auto_s"] > 0 and row["auto_recompute_s"] > 0
        # vLLM always computes the last block itself: at most tokens - 128 restored.
        assert all(0 <= n <= row["tokens"] - 128 for n in row["auto_restored"])
        # Always-restore is a request's own threshold on the same engine: it restores.
        assert all(0 < n <= row["tokens"] - 128 for n in row["restore_restored"])
        assert row["auto_vs_oracle"] > 0
    assert (tmp_path / "threshold.png").stat().st_size > 0
    assert "auto/rec" in stdout
