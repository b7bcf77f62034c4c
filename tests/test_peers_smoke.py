"""benchmarks/peers.py end to end at tiny sizes, kvtier half only.

``--skip-lmcache`` never creates or touches the LMCache venv, so ``make test`` installs
nothing; the comparison itself needs ``benchmarks/peers.py`` run by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import peers


@pytest.mark.timeout(30)
def test_peers_quick_kvtier_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "peers.json"
    missing_venv = tmp_path / "no-lmcache-venv"
    rc = peers.main(["--quick", "--skip-lmcache", "--lmcache-venv", str(missing_venv),
                     "--workdir", str(tmp_path), "--out", str(out)])
    assert rc == 0
    assert not missing_venv.exists()  # --skip-lmcache never creates the venv

    data = json.loads(out.read_text())
    assert data["benchmark"] == "peers" and data["quick"] is True
    assert data["lmcache_venv"] is None
    assert data["chunk_bytes"] % peers.TOKEN_BYTES == 0
    assert data["machine"]["cores"]
    rows = {(r["path"], r["op"]): r for r in data["rows"]}
    assert set(rows) == {("cpu", "put"), ("cpu", "get"), ("disk", "write visible"),
                         ("disk", "write durable"), ("disk", "cold read")}
    for r in rows.values():
        assert r["kvtier_gbps"] > 0
        assert len(r["kvtier_reps_gbps"]) == data["reps"] + 1
        assert r["lmcache_gbps"] is None and r["ok"] is None
    assert rows[("disk", "write durable")]["target"] == peers.DURABLE_TARGET
    assert "| cpu put |" in out.with_suffix(".md").read_text()
    assert "skipped" in capsys.readouterr().out


def test_target_verdicts() -> None:
    report = peers.Report(with_lmcache=True)
    report.add("disk", "write durable", "lm", "kv",
               {"kvtier": [9.0, 1.2, 1.2, 1.2], "lmcache": [9.0, 1.0, 1.0, 1.0]},
               peers.DURABLE_TARGET)
    report.add("cpu", "get", "lm", "kv",
               {"kvtier": [1.0, 2.0, 2.0], "lmcache": [1.0, 1.0, 1.0]}, peers.TARGET)
    miss, ok = report.rows
    assert miss["ok"] is False and miss["ratio"] == 1.2  # the dropped first rep is ignored
    assert "1.20 < 1.30" in miss["miss"] and "8% short" in miss["miss"]
    assert miss["short_pct"] == 7.7
    assert ok["ok"] is True and ok["miss"] is None
    assert report.summary() == [f"MISS disk write durable: {miss['miss']}"]
