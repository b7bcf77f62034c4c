"""Smoke run of ``benchmarks/multiturn_pd.py``: real 1P1D topology, tiny model, two lengths.

Dominated by the two vLLM server start-ups (about 1.5-4 min on two loaded cores).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_smoke_preset_records_every_turn_and_dp_reuse(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "multiturn_pd.py"), "--preset", "smoke",
         "--out-dir", str(out)],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "multiturn_pd.jsonl").read_text().splitlines()]
    seen = {(r["mode"], r["length"], r["turn"]) for r in rows}
    assert seen == {(m, n, t) for m in ("dp_on", "dp_off") for n in (256, 512) for t in (1, 2)}
    for r in rows:
        assert r["output_tokens"] == 4 and r["ttft_ms"] > 0, r
        if r["turn"] >= 2:
            assert (r["restored_tokens"] > 0) == (r["mode"] == "dp_on"), r
    summary = json.loads((out / "multiturn_pd.json").read_text())
    assert {"summary", "machine"} <= summary.keys()
    assert "PASS" in proc.stdout or "MISS" in proc.stdout
    for name in ("multiturn_pd_ttft.png", "multiturn_pd_prefill.png", "multiturn_pd.md"):
        assert (out / name).stat().st_size > 0, name
