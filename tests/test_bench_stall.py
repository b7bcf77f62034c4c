"""benchmarks/stall.py --smoke runs end to end: one tiny API server, a moto endpoint that is
SIGSTOPped and resumed (issue 10).

The shape and the correctness are checked, not the speed targets: how long a request
waits on a hung endpoint depends on the machine and on the restore path's timeouts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("healthy", "hung", "recovered")
KINDS = ("new", "returning")


@pytest.mark.vllm
def test_stall_benchmark_smoke(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "benchmarks/stall.py", "--smoke", "--out-dir", str(tmp_path),
         "--cache-dir", str(tmp_path / "models")],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((tmp_path / "stall.json").read_text())

    assert [(row["phase"], row["kind"]) for row in report["rows"]] == [
        (p, k) for p in PHASES for k in KINDS]
    assert all(row["n"] == 2 for row in report["rows"])
    assert set(report["phases"]) == set(PHASES)
    samples = report["samples"]
    assert {(s["phase"], s["kind"]) for s in samples} == {(p, k) for p in PHASES for k in KINDS}
    # Outside the hang every request is answered; a returning conversation that was
    # answered at all has exactly the tokens of a recompute.
    for s in samples:
        if s["phase"] != "hung":
            assert s["error"] is None and s["ttft_s"] is not None, s
        if s["kind"] == "returning" and s["error"] is None:
            assert s["matches_recompute"] is True, s
    names = [t["name"] for t in report["targets"]]
    assert len(names) == 3 and any("identical to a recompute" in n for n in names)
    assert all(isinstance(t["pass"], bool) for t in report["targets"])
    assert "vs healthy" in r.stdout and "targets (issue 10)" in r.stdout
