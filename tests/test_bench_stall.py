"""The hung S3 endpoint end to end in real vLLM: ``benchmarks/stall.py --smoke`` runs one
tiny API server with kvtier on a moto endpoint that is SIGSTOPped and resumed (issue 10).

Checked: every request is answered in every phase, returning conversations equal a
recompute, and nothing waits on the hung endpoint for long (a generous upper bound). The
speed targets themselves are the benchmark's, not this test's: how long a request waits
depends on the machine and on the restore path's timeouts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchrun import run_benchmark

PHASES = ("healthy", "hung", "recovered")
KINDS = ("new", "returning")


@pytest.mark.vllm
def test_stall_benchmark_smoke(tmp_path: Path, models_dir: Path) -> None:
    stdout = run_benchmark("benchmarks/stall.py", "--smoke", "--out-dir", str(tmp_path),
                           "--cache-dir", str(models_dir), timeout=600)
    report = json.loads((tmp_path / "stall.json").read_text())

    assert [(row["phase"], row["kind"]) for row in report["rows"]] == [
        (p, k) for p in PHASES for k in KINDS]
    assert all(row["n"] == 2 for row in report["rows"])
    assert set(report["phases"]) == set(PHASES)
    samples = report["samples"]
    assert {(s["phase"], s["kind"]) for s in samples} == {(p, k) for p in PHASES for k in KINDS}
    # Every request is answered, during the hang too, and a returning conversation has
    # exactly the tokens of a recompute. While S3 hangs, no request waits on it beyond
    # the lookup deadline: the bound is an upper one ("no hang"; before issue 10 each new
    # prompt waited about 100 s), not a speed target.
    for s in samples:
        assert s["error"] is None and s["ttft_s"] is not None, s
        if s["kind"] == "returning":
            assert s["matches_recompute"] is True, s
    assert max(s["ttft_s"] for s in samples if s["phase"] == "hung") < 15.0
    names = [t["name"] for t in report["targets"]]
    assert len(names) == 3 and any("identical to a recompute" in n for n in names)
    assert all(isinstance(t["pass"], bool) for t in report["targets"])
    assert "vs healthy" in stdout and "targets (issue 10)" in stdout
