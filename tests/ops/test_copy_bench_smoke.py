"""benchmarks/copy_blocks.py --quick runs end to end and writes its JSON where it is told."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_copy_benchmark_quick(tmp_path: Path) -> None:
    out = tmp_path / "copy.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "copy_blocks.py"), "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "contig" in proc.stdout
    result = json.loads(out.read_text())
    assert result["quick"] and result["machine"]["cores"] >= 1
    assert [r["block_bytes"] for r in result["results"]] == [16 * 1024, 256 * 1024]
    for row in result["results"]:
        assert row["gbps"]["torch"]["gather"] > 0
        assert row["contiguous_gbps"]["scatter"] > 0
