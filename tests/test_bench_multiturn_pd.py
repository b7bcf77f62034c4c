"""Smoke run of ``benchmarks/multiturn_pd.py``: real 1P1D topology, tiny model, two lengths.

Dominated by the two vLLM server start-ups (about 1.5-4 min on two loaded cores).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchrun import run_benchmark


@pytest.mark.vllm
def test_smoke_preset_records_every_turn_and_dp_reuse(tmp_path: Path, models_dir: Path) -> None:
    out = tmp_path / "out"
    stdout = run_benchmark("benchmarks/multiturn_pd.py", "--preset", "smoke",
                           "--out-dir", str(out), "--cache-dir", str(models_dir))
    rows = [json.loads(line) for line in (out / "multiturn_pd.jsonl").read_text().splitlines()]
    seen = {(r["mode"], r["length"], r["turn"]) for r in rows}
    assert seen == {(m, n, t) for m in ("dp_on", "dp_off") for n in (256, 512) for t in (1, 2)}
    for r in rows:
        assert r["output_tokens"] == 4 and r["ttft_ms"] > 0, r
        if r["turn"] >= 2:
            assert (r["restored_tokens"] > 0) == (r["mode"] == "dp_on"), r
    summary = json.loads((out / "multiturn_pd.json").read_text())
    assert {"summary", "machine"} <= summary.keys()
    assert "PASS" in stdout or "MISS" in stdout
    for name in ("multiturn_pd_ttft.png", "multiturn_pd_prefill.png", "multiturn_pd.md"):
        assert (out / name).stat().st_size > 0, name
